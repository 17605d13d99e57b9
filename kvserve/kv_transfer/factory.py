"""Build a worker's KV connector from its :class:`KVTransferConfig` (over TCP).

Rules: call :func:`build_connector` before the engine (its result goes to
``EngineCore(kv_connector=...)``); role "both" gets None, i.e. today's engine.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.kv_transfer.config import (
    DEFAULT_REMOTE_MIN_TOKENS,
    DEFAULT_TRANSFER_TIMEOUT_S,
    POOLS_REMOTE_MIN_TOKENS,
    KVTransferConfig,
    parse_address,
)


def build_connector(
    config: KVTransferConfig, *, block_size: int, kv_dtype: str, hash_algo: str = "sha256"
) -> Any:
    """The connector of ``config.kv_role`` on a ZeroMQ transport, or None for "both".
    ``kv_dtype``: the KV cache dtype name ("bfloat16", ...), checked on received chunks.
    Raises ValueError unless block hashes are stable across processes (sha256)."""
    config.validate()
    if config.kv_role == "both":
        return None
    if hash_algo != "sha256":
        raise ValueError(
            f"invalid hash_algo={hash_algo!r} with --kv-role {config.kv_role}: prefill and "
            "decode workers compare block hashes across processes, which needs the stable "
            "sha256 hashes (for example: --hash-algo sha256)"
        )
    from kvserve.kv_transfer.tcp import DealerTransport, RouterTransport

    if config.kv_role == "prefill":
        from kvserve.kv_transfer.prefill_connector import PrefillConnector

        assert config.kv_address is not None  # validate() checked it
        host, port = parse_address(config.kv_address, "--kv-address")
        return PrefillConnector(config, RouterTransport(host, port), block_size=block_size)
    from kvserve.kv_transfer.decode_connector import DecodeConnector

    transport = DealerTransport(list(config.kv_prefill_peers))
    return DecodeConnector(config, transport, block_size=block_size, kv_dtype=kv_dtype)


def add_kv_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--kv-*`` flags of ``kvserve serve`` (see ``kvserve.kv_transfer.config``)."""
    group = parser.add_argument_group("disaggregated prefill/decode")
    group.add_argument(
        "--kv-role",
        choices=["both", "prefill", "decode"],
        default="both",
        help="both (default): one process does everything; prefill: a prefill worker "
        "(needs --kv-address); decode: serves the API, prefills on --kv-prefill-peers",
    )
    group.add_argument(
        "--kv-address", default=None, help="prefill worker: HOST:PORT to accept prefill work on"
    )
    group.add_argument(
        "--kv-prefill-peers",
        default="",
        help="decode worker: prefill workers, HOST:PORT[,HOST:PORT...]",
    )
    group.add_argument(
        "--kv-remote-min-tokens",
        type=int,
        default=None,
        help=f"decode worker: prefill locally when fewer uncached prompt tokens remain "
        f"(default {DEFAULT_REMOTE_MIN_TOKENS}; with --prefill-replicas/--decode-replicas "
        f"{POOLS_REMOTE_MIN_TOKENS}: every full block comes from the prefill pool)",
    )
    group.add_argument(
        "--kv-stream-chunks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill worker: push each chunk's blocks when its step ends (default), or "
        "everything at the end (--no-kv-stream-chunks)",
    )
    group.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=DEFAULT_TRANSFER_TIMEOUT_S,
        help=f"seconds a peer may stay silent about a request before it fails; the prefill "
        f"worker's lease on unclaimed blocks is twice this (default {DEFAULT_TRANSFER_TIMEOUT_S:g})",
    )
    group.add_argument(
        "--kv-load-failure-policy",
        choices=["recompute", "fail"],
        default="recompute",
        help="decode worker, when a transfer fails: recompute the missing KV locally "
        "(default) or fail the request with HTTP 503",
    )


def kv_transfer_config_from_args(
    args: argparse.Namespace, *, pools: bool = False
) -> KVTransferConfig:
    """The ``--kv-*`` flags as a checked config; ``pools``: for prefill/decode pools
    (an unset ``--kv-remote-min-tokens`` is then POOLS_REMOTE_MIN_TOKENS)."""
    min_tokens = args.kv_remote_min_tokens
    if min_tokens is None:
        min_tokens = POOLS_REMOTE_MIN_TOKENS if pools else DEFAULT_REMOTE_MIN_TOKENS
    peers = tuple(p.strip() for p in (args.kv_prefill_peers or "").split(",") if p.strip())
    config = KVTransferConfig(
        kv_role=args.kv_role,
        kv_address=args.kv_address,
        kv_prefill_peers=peers,
        kv_remote_min_tokens=min_tokens,
        kv_stream_chunks=args.kv_stream_chunks,
        kv_transfer_timeout=args.kv_transfer_timeout,
        kv_load_failure_policy=args.kv_load_failure_policy,
    )
    config.validate()
    return config
