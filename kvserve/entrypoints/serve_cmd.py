"""``kvserve serve``: the OpenAI-compatible server on uvicorn.

    kvserve serve --host 127.0.0.1 --port 8000 [--api-key KEY] [--max-queue-len N]
                  [--served-model-name NAME] [engine options: --model, --max-num-seqs, ...]
                  [--kv-role both|prefill|decode ...]   (docs/disaggregation.md)

``--kv-role prefill`` serves only ``/health`` and ``/metrics`` over HTTP and takes
prefill work on ``--kv-address``; ``--kv-role decode`` serves the OpenAI API and
prefills long prompts on ``--kv-prefill-peers``.

The model loads before the port opens, so ``GET /health`` answering 200 means
ready. SIGTERM or SIGINT: the listening socket closes, in-flight requests get
``--graceful-shutdown-timeout`` seconds to finish, the rest are aborted (their
streams end), the engine thread stops, and the command returns 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import uvicorn

from kvserve.engine.args import add_engine_arguments, build_engine_config, engine_kwargs_from_args
from kvserve.kv_transfer.factory import (
    add_kv_transfer_arguments,
    build_connector,
    kv_transfer_config_from_args,
)

logger = logging.getLogger("kvserve.serve")


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 such as 64, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVSERVE_API_KEY)",
    )
    parser.add_argument(
        "--max-queue-len",
        type=_non_negative_int,
        default=None,
        help="answer 503 + Retry-After once this many requests wait to be scheduled",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model's own name)",
    )
    parser.add_argument(
        "--graceful-shutdown-timeout",
        type=_non_negative_int,
        default=30,
        help="seconds in-flight requests get to finish after SIGTERM (default 30)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default info)",
    )
    parser.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log one line per HTTP request (default on)",
    )
    add_engine_arguments(parser)
    add_kv_transfer_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.engine_core import EngineCore
    from kvserve.entrypoints.openai_server import build_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    api_key = args.api_key or os.environ.get("KVSERVE_API_KEY") or None
    t0 = time.perf_counter()
    try:
        config = build_engine_config(**engine_kwargs_from_args(args))
        kv_config = kv_transfer_config_from_args(args)
        if kv_config.kv_role == "both":
            engine = EngineCore(config)
        else:
            from kvserve.model.loader import load_model

            loaded = load_model(
                config.model.model, dtype=config.model.dtype, device=config.model.device
            )
            connector = build_connector(
                kv_config,
                block_size=config.cache.block_size,
                kv_dtype=loaded.dtype_name,
                hash_algo=config.cache.hash_algo,
            )
            engine = EngineCore(config, loaded=loaded, kv_connector=connector)
    except (ValueError, TypeError) as e:
        print(f"kvserve serve: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    # The process serves from here on: move everything loaded so far out of the
    # cyclic GC's sight, so per-step collections scan only what steps allocate.
    gc.collect()
    gc.freeze()
    async_engine = AsyncEngine(engine)
    if kv_config.kv_role == "prefill":
        from kvserve.entrypoints.prefill_app import build_prefill_app
        from kvserve.kv_transfer.prefill_service import PrefillService

        service = PrefillService(async_engine, engine.kv_connector, engine.kv_connector.transport)
        app = build_prefill_app(async_engine, service)
    else:
        app = build_app(
            async_engine,
            api_key=api_key,
            served_model_name=args.served_model_name,
            max_queue_len=args.max_queue_len,
        )
    logger.info(
        "loaded %s in %.1f s (dtype=%s, attention=%s, max_model_len=%d, %d KV blocks, "
        "kv-role %s); serving on http://%s:%d%s",
        engine.model_name,
        load_s,
        engine.loaded.dtype_name,
        engine.runner.attention_backend,
        engine.max_model_len,
        engine.kv_cache_manager.num_blocks,
        kv_config.kv_role,
        args.host,
        args.port,
        " (API key required)" if api_key else "",
    )
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=args.access_log,
            timeout_graceful_shutdown=args.graceful_shutdown_timeout,
        )
    )
    server.run()
    if server.started:
        return 0
    return 1


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT that triggered the graceful
    shutdown is not re-raised afterwards (uvicorn re-raises it, which turns a clean
    shutdown into exit status -15)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
