"""The two connectors over the in-process transport, with real KV tensors and no
model: whatever the link does to the messages (drop, duplicate, reorder), the decode
side ends with one result, loads exactly the blocks it reports, and neither side
keeps any state or blocks afterwards."""

from __future__ import annotations

import random
import time

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kv_connector import Clock, connector_pair, finished_loads, hashed_request, one_step

from kvserve.engine.metrics import EngineMetrics
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.decode_connector import DecodeConnector
from kvserve.kv_transfer.prefill_connector import PrefillConnector
from kvserve.kv_transfer.transport import in_process_pair
from kvserve.kv_transfer.wire import Cancel, Claim, PrefillRequest, decode_message
from kvserve.request import RequestStatus

B = 4
NUM_CACHE_BLOCKS = 32


def _cache(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 1, NUM_CACHE_BLOCKS, B, 2, generator=g)


def _wait_sent(prefill: PrefillConnector) -> None:
    deadline = time.monotonic() + 10
    while any(p.queued for p in prefill._pushes.values()) and time.monotonic() < deadline:
        time.sleep(0.001)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_full=st.integers(2, 7),
    remainder=st.integers(1, B),
    hit_blocks=st.integers(0, 1),
    chunk_blocks=st.integers(1, 3),
    stream=st.booleans(),
    policy=st.sampled_from(["recompute", "fail"]),
    fate=st.lists(st.sampled_from(["keep", "keep", "drop", "dup"]), min_size=12, max_size=12),
    order_seed=st.integers(0, 1000),
)
def test_any_drop_duplicate_or_reorder_ends_cleanly(
    num_full, remainder, hit_blocks, chunk_blocks, stream, policy, fate, order_seed
):
    clock = Clock()
    decode, prefill, dec_end, pre_end = connector_pair(
        clock, B, kv_dtype="float32", policy=policy, stream=stream, kv_transfer_timeout=1.0
    )
    to_prefill: list = []
    pre_end.set_receiver(lambda peer, msg: to_prefill.append(msg))
    # Everything the prefill side sends is held back, then delivered as `fate` says.
    held: list = []
    pre_end.intercept = lambda frames: held.append(frames) or []
    try:
        src, dst = _cache(order_seed), torch.zeros(2, 2, 1, NUM_CACHE_BLOCKS, B, 2)
        prefill.register_kv_cache(src)
        decode.register_kv_cache(dst)
        decode.peers.pong("prefill", 0)

        rng = random.Random(order_seed)
        prompt_len = num_full * B + remainder
        tokens = [rng.randrange(1000) for _ in range(prompt_len)]
        d_req = hashed_request("r", tokens, NUM_CACHE_BLOCKS, B)
        hit = hit_blocks * B
        n = decode.get_num_new_matched_tokens(d_req, hit)
        p_full = (prompt_len - 1) // B * B
        assert n == p_full - hit
        if n == 0:
            return
        d_blocks = rng.sample(range(1, NUM_CACHE_BLOCKS), num_full + 1)
        d_req.num_computed_tokens = hit
        decode.update_state_after_alloc(d_req, d_blocks, n)
        dec_end.flush()
        pre_end.flush()
        (ask,) = to_prefill
        assert isinstance(ask, PrefillRequest) and ask.first_block == hit_blocks
        assert ask.num_blocks == n // B and ask.prompt_token_ids == tokens

        # The prefill side computes the prompt in chunks of chunk_blocks blocks.
        p_req = hashed_request("peer/r", tokens, NUM_CACHE_BLOCKS, B)
        p_blocks = rng.sample(range(1, NUM_CACHE_BLOCKS), num_full + 1)
        assert prefill.track("peer/r", "r", "decode", ask.first_block, ask.num_blocks)
        assert not prefill.track("peer/r", "r", "decode", ask.first_block, ask.num_blocks)
        prefill.update_state_after_alloc(p_req, p_blocks, 0)
        start = 0
        while start < prompt_len:
            step_n = min(chunk_blocks * B, prompt_len - start)
            meta = prefill.build_connector_meta(one_step("peer/r", start, step_n))
            if meta is not None:
                prefill.save_kv(meta)
            start += step_n
        p_req.append_output_token_ids(7)
        p_req.status = RequestStatus.FINISHED_LENGTH
        assert prefill.request_finished(p_req, p_blocks) is True
        _wait_sent(prefill)

        # The link: drop, duplicate, then reorder.
        delivered = []
        for i, frames in enumerate(held):
            f = fate[i % len(fate)]
            delivered += [] if f == "drop" else [frames] * (2 if f == "dup" else 1)
        rng.shuffle(delivered)
        all_arrived = {
            i
            for f in delivered
            if (m := decode_message(f)).kind == "chunk"
            for i in m.block_indices
        } >= set(range(ask.first_block, ask.first_block + ask.num_blocks))
        for frames in delivered:
            dec_end._queue.put(("prefill", frames))
        dec_end.flush()

        results = finished_loads(decode, clock)
        (result,) = results
        assert decode.stats.snapshot().in_flight == 0
        if all_arrived:
            assert result.error is None and result.num_tokens_ok == n
        else:
            assert result.error is not None and result.fatal == (policy == "fail")
            assert result.num_tokens_ok < n
        # Exactly the blocks reported are loaded, with the prefill side's KV.
        for k in range(result.num_tokens_ok // B):
            i = hit_blocks + k
            assert torch.equal(dst[:, :, :, d_blocks[i]], src[:, :, :, p_blocks[i]])

        # The decode side claims or cancels; either way the prefill side lets go.
        dec_end.flush()
        pre_end.flush()
        final = to_prefill[-1]
        assert isinstance(final, Claim if result.error is None else Cancel)
        prefill.release("peer/r")
        assert prefill.get_finished_sending() == {"peer/r"} and prefill.load == 0
    finally:
        decode.close()
        prefill.close()


def test_unclaimed_blocks_are_freed_after_the_lease():
    clock = Clock()
    _, pre_end = in_process_pair()
    cfg = KVTransferConfig(kv_role="prefill", kv_address="x:1", kv_transfer_timeout=1.0)
    prefill = PrefillConnector(cfg, pre_end, block_size=B, clock=clock)
    try:
        prefill.register_kv_cache(_cache(0))
        tokens = list(range(3 * B + 1))
        p_req = hashed_request("peer/r", tokens, NUM_CACHE_BLOCKS, B)
        prefill.track("peer/r", "r", "decode", 0, 3)
        prefill.update_state_after_alloc(p_req, [1, 2, 3, 4], 0)
        prefill.save_kv(prefill.build_connector_meta(one_step("peer/r", 0, len(tokens))))
        p_req.append_output_token_ids(7)
        p_req.status = RequestStatus.FINISHED_LENGTH
        assert prefill.request_finished(p_req, [1, 2, 3, 4]) is True
        _wait_sent(prefill)
        assert prefill.get_finished_sending() == set()  # held for a claim
        clock.now += cfg.lease_s - 0.1
        assert prefill.get_finished_sending() == set()
        clock.now += 0.2
        assert prefill.get_finished_sending() == {"peer/r"} and prefill.load == 0
        # A claim that comes after the lease is harmless.
        assert prefill.release("peer/r") is False
    finally:
        prefill.close()


def test_late_and_foreign_chunks_are_ignored():
    clock = Clock()
    dec_end, pre_end = in_process_pair()
    cfg = KVTransferConfig(kv_role="decode", kv_prefill_peers=("prefill",), kv_remote_min_tokens=1)
    decode = DecodeConnector(
        cfg, dec_end, block_size=B, kv_dtype="float32", clock=clock, ping=False
    )
    prefill = PrefillConnector(
        KVTransferConfig(kv_role="prefill", kv_address="x:1"), pre_end, block_size=B, clock=clock
    )
    try:
        prefill.register_kv_cache(_cache(1))
        decode.register_kv_cache(torch.zeros(2, 2, 1, NUM_CACHE_BLOCKS, B, 2))
        # Chunks for a request the decode side never asked for (or already ended).
        tokens = list(range(2 * B + 1))
        p_req = hashed_request("peer/ghost", tokens, NUM_CACHE_BLOCKS, B)
        prefill.track("peer/ghost", "ghost", "decode", 0, 2)
        prefill.update_state_after_alloc(p_req, [1, 2, 3], 0)
        prefill.save_kv(prefill.build_connector_meta(one_step("peer/ghost", 0, len(tokens))))
        _wait_sent(prefill)
        dec_end.flush()
        assert decode.build_connector_meta(None) is None and decode.get_finished_loads() == []
        # A request aborted on the decode side sends "cancel" and keeps nothing.
        d_req = hashed_request("r", tokens, NUM_CACHE_BLOCKS, B)
        decode.peers.pong("prefill", 0)
        decode.update_state_after_alloc(d_req, [5, 6, 7], 2 * B)
        assert decode.stats.snapshot().in_flight == 1
        metrics = EngineMetrics("m")
        metrics.set_transfer_source(decode.stats.snapshot)
        assert b'kv_transfer_in_flight{model_name="m"} 1.0' in metrics.render()
        assert decode.request_finished(d_req, [5, 6, 7]) is False
        assert decode.stats.snapshot().in_flight == 0
        assert b'kv_transfer_in_flight{model_name="m"} 0.0' in metrics.render()
    finally:
        decode.close()
        prefill.close()
