"""8-bit KV caches over the KV transfer wire: an int8 prefill worker feeds an int8 decode
worker block for block; an int8 prefill worker and a bfloat16 decode worker never
exchange blocks (the prefill side refuses the request, the decode side refuses chunks
of another dtype before touching its cache), and their block hashes differ."""

from __future__ import annotations

import time

import torch
from support.kv_connector import Clock, connector_pair, finished_loads, hashed_request, one_step

from kvserve.kv_transfer.prefill_service import PrefillService
from kvserve.kv_transfer.wire import Chunk, PrefillRequest, decode_message, encode_message
from kvserve.model.kernels.kv8 import kv_cache_fingerprint, resolve_kv_cache_dtype
from kvserve.request import RequestStatus

B = 4
NUM_BLOCKS = 16
D = 8  # head_dim; 8-bit rows are D + 4 bytes


def _int8_cache(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (2, 2, 1, NUM_BLOCKS, B, D + 4), generator=g).to(torch.int8)


def _run(prefill_cache: torch.Tensor, decode_cache: torch.Tensor, decode_dtype: str):
    """Decode asks for a 2-block prompt, the prefill side computes and pushes it
    (whatever its service would say), the decode side collects its one result."""
    clock = Clock()
    decode, prefill, dec_end, pre_end = connector_pair(
        clock, B, kv_dtype=decode_dtype, policy="fail"
    )
    asks: list = []
    pre_end.set_receiver(lambda peer, msg: asks.append(msg))
    try:
        prefill.register_kv_cache(prefill_cache)
        decode.register_kv_cache(decode_cache)
        decode.peers.pong("prefill", 0)
        tokens = list(range(2 * B + 1))
        d_req = hashed_request("r", tokens, NUM_BLOCKS, B)
        n = decode.get_num_new_matched_tokens(d_req, 0)
        decode.update_state_after_alloc(d_req, [3, 5, 7], n)
        dec_end.flush()
        pre_end.flush()
        (ask,) = asks
        refusal = PrefillService(None, prefill, pre_end)._check(ask)
        p_req = hashed_request("peer/r", tokens, NUM_BLOCKS, B)
        prefill.track("peer/r", "r", "decode", ask.first_block, ask.num_blocks)
        prefill.update_state_after_alloc(p_req, [2, 4, 6], 0)
        prefill.save_kv(prefill.build_connector_meta(one_step("peer/r", 0, len(tokens))))
        p_req.append_output_token_ids(1)
        p_req.status = RequestStatus.FINISHED_LENGTH
        prefill.request_finished(p_req, [2, 4, 6])
        deadline = time.monotonic() + 10
        while any(p.queued for p in prefill._pushes.values()) and time.monotonic() < deadline:
            time.sleep(0.001)
        dec_end.flush()
        results = finished_loads(decode, clock)
        (result,) = results
        return ask, refusal, result
    finally:
        decode.close()
        prefill.close()


def test_int8_blocks_move_between_int8_workers():
    src = _int8_cache(0)
    dst = torch.zeros_like(src)
    ask, refusal, result = _run(src, dst, "int8")
    assert ask.kv_dtype == "int8" and refusal is None
    assert result.error is None and result.num_tokens_ok == 2 * B
    for d_block, p_block in ((3, 2), (5, 4)):
        assert torch.equal(dst[:, :, :, d_block], src[:, :, :, p_block])  # codes and scales


def test_int8_prefill_and_bf16_decode_never_exchange_blocks():
    src = _int8_cache(1)
    dst = torch.zeros(2, 2, 1, NUM_BLOCKS, B, D, dtype=torch.bfloat16)
    ask, refusal, result = _run(src, dst, "bfloat16")
    # the prefill worker's service refuses the request with the fix...
    assert ask.kv_dtype == "bfloat16"
    assert refusal is not None and "KV cache dtype mismatch" in refusal
    assert "int8" in refusal and "--kv-cache-dtype" in refusal
    # ...and chunks pushed anyway are refused by the decode side, its cache untouched
    assert result.error is not None and "KV cache dtype mismatch" in result.error
    assert result.num_tokens_ok == 0
    assert torch.count_nonzero(dst) == 0


def test_wire_carries_8bit_chunks():
    payload = bytes(range(2 * 1 * 1 * 1 * B * (D + 4)))
    for dtype in ("int8", "fp8_e4m3"):
        chunk = Chunk("r", [0], ["ab"], dtype, [1, 2, 1, 1, B, D + 4], 1.0, payload)
        back = decode_message(encode_message(chunk))
        assert isinstance(back, Chunk) and back.dtype == dtype
        assert bytes(back.payload) == payload
    ask = decode_message(encode_message(PrefillRequest("r", [1, 2], 0, 1, None, "int8")))
    assert isinstance(ask, PrefillRequest) and ask.kv_dtype == "int8"


def test_block_hashes_differ_by_kv_format():
    tokens = list(range(3 * B))
    bf16 = resolve_kv_cache_dtype("auto", torch.bfloat16)
    fps = {
        name: kv_cache_fingerprint(
            "model-fp", resolve_kv_cache_dtype(name, torch.bfloat16), torch.bfloat16
        )
        for name in ("auto", "bfloat16", "int8", "fp8_e4m3")
    }
    assert fps["auto"] == fps["bfloat16"] == "model-fp"  # the same storage: shared
    assert kv_cache_fingerprint("model-fp", bf16, torch.bfloat16) == "model-fp"
    hashes = {
        name: hashed_request("r", tokens, NUM_BLOCKS, B, fp).block_hashes
        for name, fp in fps.items()
    }
    assert hashes["int8"] != hashes["bfloat16"] and hashes["fp8_e4m3"] != hashes["int8"]
    assert hashes["fp8_e4m3"] != hashes["bfloat16"]
    assert all(a != b for a, b in zip(hashes["int8"], hashes["bfloat16"], strict=True))
