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
from pathlib import Path

import uvicorn

from kvserve.engine.args import add_engine_arguments, build_engine_config, engine_kwargs_from_args
from kvserve.kv_transfer.factory import (
    add_kv_transfer_arguments,
    build_connector,
    kv_transfer_config_from_args,
)

logger = logging.getLogger("kvserve.serve")


GC_GEN0_THRESHOLD = 70_000  # allocations between young collections while serving


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
    scale = parser.add_argument_group(
        "scale-out (Ray Serve; needs the 'ray' extra: pip install -e '.[ray]')"
    )
    scale.add_argument(
        "--replicas",
        type=_non_negative_int,
        default=None,
        help="run N >= 2 engine replicas on Ray Serve behind this endpoint (default: one "
        "engine in this process)",
    )
    scale.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. 10.0.0.5:6379 after 'ray start --head'); default: "
        "start a local one on 127.0.0.1",
    )
    scale.add_argument(
        "--threads-per-replica",
        type=_non_negative_int,
        default=None,
        help="torch threads of each replica (default: this machine's cores / N)",
    )
    scale.add_argument(
        "--routing",
        default="prefix-aware",
        choices=["prefix-aware", "round-robin", "least-loaded"],
        help="request routing across replicas (default prefix-aware)",
    )
    for role in ("prefill", "decode"):
        scale.add_argument(
            f"--{role}-replicas",
            type=_non_negative_int,
            default=None,
            help=f"{role} pool size for disaggregated serving: not available yet (the "
            "prefill/decode roles have not landed; the flag is refused)",
        )
    add_engine_arguments(parser)
    add_kv_transfer_arguments(parser)


def _run_replicas(args: argparse.Namespace, api_key: str | None) -> int:
    """``--replicas N``: the Ray Serve app (``kvserve.cluster``, imported only here)."""
    if args.prefill_replicas is not None or args.decode_replicas is not None:
        print(
            "kvserve serve: --prefill-replicas/--decode-replicas are not available yet: the "
            "disaggregated prefill and decode roles (--kv-role) have not landed in this build; "
            "use --replicas N for N identical engine replicas",
            file=sys.stderr,
        )
        return 2
    try:
        from kvserve.cluster.app import ClusterOptions
        from kvserve.cluster.launcher import run_cluster
        from kvserve.cluster.policy import RoutingConfig
    except ImportError as e:
        print(
            f"kvserve serve: --replicas needs Ray Serve ({e}); install it with "
            "pip install -e '.[ray]' (make setup does)",
            file=sys.stderr,
        )
        return 2
    n = args.replicas
    threads = args.threads_per_replica or max(1, (os.cpu_count() or 1) // max(n, 1))
    try:
        options = engine_kwargs_from_args(args)
        if options.get("hash_algo") == "builtin":
            raise ValueError(
                "--hash-algo builtin gives different hashes in every process, so the router "
                "cannot predict the replicas' caches: use --hash-algo sha256 with --replicas"
            )
        build_engine_config(**options)
        if not args.ray_address:  # fail fast on a bad --model (and convert it once, here)
            from kvserve.model.loader import (
                DEFAULT_MODEL_NAME,
                gguf_source,
                resolve_gguf_metadata,
                resolve_model,
            )

            model_name = options.get("model") or DEFAULT_MODEL_NAME
            gguf = gguf_source(model_name)
            if gguf is not None and options.get("quantization", "auto") != "none":
                resolve_gguf_metadata(gguf, Path(model_name).stem)  # runs quantized
            else:
                resolve_model(model_name)
        opts = ClusterOptions(
            num_replicas=n,
            threads_per_replica=threads,
            engine_options=options,
            routing=RoutingConfig(policy=args.routing),
            served_model_name=args.served_model_name,
            api_key=api_key,
            max_queue_len=args.max_queue_len,
        )
    except (ValueError, TypeError) as e:
        print(f"kvserve serve: {e}", file=sys.stderr)
        return 2
    return run_cluster(opts, host=args.host, port=args.port, ray_address=args.ray_address)


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.async_engine import AsyncEngine, run_in_scratch_thread
    from kvserve.engine.engine_core import EngineCore
    from kvserve.entrypoints.openai_server import build_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    api_key = args.api_key or os.environ.get("KVSERVE_API_KEY") or None
    if (
        args.replicas is not None
        or args.prefill_replicas is not None
        or args.decode_replicas is not None
    ):
        return _run_replicas(args, api_key)
    t0 = time.perf_counter()
    try:
        config = build_engine_config(**engine_kwargs_from_args(args))
        kv_config = kv_transfer_config_from_args(args)

        def build() -> EngineCore:
            if kv_config.kv_role == "both":
                return EngineCore(config)
            from kvserve.model.loader import load_model

            loaded = load_model(
                config.model.model,
                dtype=config.model.dtype,
                device=config.model.device,
                quantization=config.model.quantization,
            )
            connector = build_connector(
                kv_config,
                block_size=config.cache.block_size,
                kv_dtype=loaded.dtype_name,
                hash_algo=config.cache.hash_algo,
            )
            return EngineCore(config, loaded=loaded, kv_connector=connector)

        engine = run_in_scratch_thread(build)
    except (ValueError, TypeError) as e:
        print(f"kvserve serve: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    # The process serves from here on: move everything loaded so far out of the
    # cyclic GC's sight, so per-step collections scan only what steps allocate.
    gc.collect()
    gc.freeze()
    # Steps allocate many short-lived objects and the prefix cache keeps many
    # long-lived ones: with CPython's default thresholds (700, 10, 10) the collector
    # ran so often that a server that had served one workload lost a quarter of its
    # throughput on the next (full collections over the cache's objects). Collect
    # young objects 100x less often and full collections 1,000x less often (cycles
    # are still freed, later; measured: prefix workload right after a random one,
    # bf16, 171 -> 294 tok/s; 207 with (70_000, 10, 10)).
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 100)
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
    from kvserve.model.memory import memory_report

    logger.info("resident memory: %s", memory_report(engine).describe())
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
