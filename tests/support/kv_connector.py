"""Pieces of the KV connector tests: a settable clock, a decode and a prefill
connector joined in process, a request with its block hashes, one step's scheduler
output for one request, and the wait for a load."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvserve.kv_cache import KVCacheManager
from kvserve.request import Request, SamplingParams


def connector_pair(
    clock: Clock,
    block_size: int,
    *,
    kv_dtype: str,
    policy: str,
    stream: bool = True,
    **decode_options: Any,
) -> tuple[Any, Any, Any, Any]:
    """(decode, prefill, decode end, prefill end): a decode connector whose one prefill
    peer is "prefill" (remote loads from 1 token, ``policy`` on a failed load, more
    ``decode_options`` of KVTransferConfig; no pings) and that peer's prefill connector
    (``stream``: chunks streamed, the default), over an in-process transport pair, both on ``clock``.
    The caller registers the caches and closes the connectors."""
    from kvserve.kv_transfer.config import KVTransferConfig
    from kvserve.kv_transfer.decode_connector import DecodeConnector
    from kvserve.kv_transfer.prefill_connector import PrefillConnector
    from kvserve.kv_transfer.transport import in_process_pair

    dec_end, pre_end = in_process_pair("decode", "prefill")
    dcfg = KVTransferConfig(
        kv_role="decode",
        kv_prefill_peers=("prefill",),
        kv_remote_min_tokens=1,
        kv_load_failure_policy=policy,
        **decode_options,
    )
    pcfg = KVTransferConfig(kv_role="prefill", kv_address="x:1", kv_stream_chunks=stream)
    decode = DecodeConnector(
        dcfg, dec_end, block_size=block_size, kv_dtype=kv_dtype, clock=clock, ping=False
    )
    prefill = PrefillConnector(pcfg, pre_end, block_size=block_size, clock=clock)
    return decode, prefill, dec_end, pre_end


class Clock:
    """A clock the test moves (``now``, seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hashed_request(
    req_id: str, tokens: list[int], num_blocks: int, block_size: int, fingerprint: str = ""
) -> Request:
    """A one-token greedy request with the block hashes of a cache of that shape."""
    request = Request(req_id, tokens, SamplingParams(max_tokens=1, temperature=0.0))
    KVCacheManager(num_blocks, block_size, 256, model_fingerprint=fingerprint).block_hashes(request)
    return request


def one_step(req_id: str, start: int, n: int) -> SimpleNamespace:
    """What a connector reads of a step that computes ``n`` tokens of ``req_id`` from
    position ``start``."""
    return SimpleNamespace(
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
        num_scheduled_tokens={req_id: n},
        cached_seq_len={req_id: start},
    )


def finished_loads(decode: Any, clock: Clock) -> list[Any]:
    """Run the decode connector's load step until a load finishes, moving ``clock``
    2 s past each empty try (past the timeout: a silent peer fails the load); at most
    3 tries. Returns what finished (empty if nothing did)."""
    results: list[Any] = []
    for _ in range(3):
        meta = decode.build_connector_meta(None)
        if meta is not None:
            decode.load_kv(meta)
        results += decode.get_finished_loads()
        if results:
            break
        clock.now += 2.0
    return results
