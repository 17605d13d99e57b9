"""``kvserve serve``: the OpenAI-compatible server on uvicorn.

    kvserve serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY] [--max-queue-len N]
                  [--served-model-name NAME] [engine options: --model, --max-num-seqs, ...]
                  [--kv-role both|prefill|decode ...]   (docs/disaggregation.md)
                  [vLLM's flags: --seed, --generation-config, --enable-auto-tool-choice
                   --tool-call-parser hermes, --tensor-parallel-size 1, ... (vllm_flags)]

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
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from kvserve.engine.admission import DEFAULT_MAX_PROMPTS_PER_REQUEST
from kvserve.engine.args import add_engine_arguments, build_engine_config, engine_kwargs_from_args
from kvserve.engine.vllm_compat import generation_defaults
from kvserve.entrypoints import vllm_flags
from kvserve.kv_transfer.factory import (
    add_kv_transfer_arguments,
    build_connector,
    kv_transfer_config_from_args,
)

logger = logging.getLogger("kvserve.serve")


FLUSH_TIMEOUT_S = 5  # after the drain: time to write out the cut responses
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
        help="answer 429 + Retry-After when a request's sequences (prompts x n) would make "
        "more than this many wait to be scheduled (default: no limit)",
    )
    parser.add_argument(
        "--max-prompts-per-request",
        type=_non_negative_int,
        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
        help="refuse (400) a completions request with more prompts than this (default "
        f"{DEFAULT_MAX_PROMPTS_PER_REQUEST}; 0: no limit)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model's own name)",
    )
    hardening = parser.add_argument_group("chat templates and request limits (docs/security.md)")
    hardening.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|STRING",
        help="the chat template: a .jinja file or the template text (default: the model's own)",
    )
    hardening.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat_template (default: refused with 400; a "
        "template is code, so only for trusted clients)",
    )
    hardening.add_argument(
        "--chat-template-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a chat template render past this is stopped and answered 400 (default 5)",
    )
    hardening.add_argument(
        "--max-request-body-bytes",
        type=_non_negative_int,
        default=None,
        help="answer 413 for larger bodies (default: max(8 MiB, 64 x max_model_len x "
        "max_num_seqs))",
    )
    hardening.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="send CORS headers for these origins ('*' for any; default: none, so browsers "
        "keep other sites' pages from reading answers)",
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
        "--min-healthy-replicas",
        type=_non_negative_int,
        default=None,
        help="GET /health answers 503 while fewer replicas than this are alive (default: "
        "all --replicas)",
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
    vllm_flags.add_arguments(parser)


def http_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``build_app`` keyword arguments of the chat/limits flags; raises ValueError
    (with the fix) for a template that cannot be read or compiled."""
    from kvserve.entrypoints.chat.template import TemplateError, load_chat_template

    out: dict[str, Any] = {
        "trust_request_chat_template": bool(args.trust_request_chat_template),
        "max_request_body_bytes": args.max_request_body_bytes or None,
        "allowed_origins": args.allowed_origins or None,
    }
    if args.chat_template is not None:
        try:
            out["chat_template"] = load_chat_template(args.chat_template)
        except TemplateError as e:
            raise ValueError(f"--chat-template: {e}") from None
    if args.chat_template_timeout is not None:
        if not args.chat_template_timeout > 0:
            raise ValueError(
                f"--chat-template-timeout must be > 0 seconds, got {args.chat_template_timeout}"
            )
        out["chat_template_timeout_s"] = args.chat_template_timeout
    return out


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
        options, notices = vllm_flags.engine_options(args, engine_kwargs_from_args(args))
        for notice in notices:
            print(f"kvserve serve: {notice}", file=sys.stderr)
        unsupported = [
            flag
            for flag, on in (
                ("--enable-auto-tool-choice", args.enable_auto_tool_choice),
                ("--seed", args.seed is not None),
                ("--max-logprobs", args.max_logprobs != vllm_flags.MAX_LOGPROBS),
                ("--enable-log-requests", args.log_requests),
            )
            if on
        ]
        if unsupported:
            raise ValueError(
                f"{', '.join(unsupported)} cannot be combined with --replicas yet (the Ray "
                "Serve ingress does not pass them on): drop them or serve one engine"
            )
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
            min_healthy_replicas=args.min_healthy_replicas,
            http_options=http_options_from_args(args),
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
        http_options = http_options_from_args(args)
        options, notices = vllm_flags.engine_options(args, engine_kwargs_from_args(args))
        for notice in notices:
            logger.info("%s", notice)
        prefix = vllm_flags.metrics_prefix(args.metrics_prefix)
        config = build_engine_config(**options)
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
            from kvserve.model.kernels.kv8 import resolve_kv_cache_dtype

            connector = build_connector(
                kv_config,
                block_size=config.cache.block_size,
                kv_dtype=resolve_kv_cache_dtype(config.cache.kv_cache_dtype, loaded.dtype).name,
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
        from kvserve.kv_transfer.prefill_connector import PrefillConnector
        from kvserve.kv_transfer.prefill_service import PrefillService

        connector = engine.kv_connector
        assert isinstance(connector, PrefillConnector)  # what kv_role "prefill" builds
        service = PrefillService(async_engine, connector, connector.transport)
        app = build_prefill_app(async_engine, service)
    else:
        try:
            defaults = generation_defaults(
                args.generation_config, getattr(engine.loaded, "model_dir", None)
            )
        except ValueError as e:
            print(f"kvserve serve: {e}", file=sys.stderr)
            return 2
        if defaults:
            logger.info("default sampling from generation_config.json: %s", defaults)
        app = build_app(
            async_engine,
            api_key=api_key,
            served_model_name=args.served_model_name,
            max_queue_len=args.max_queue_len,
            max_prompts_per_request=args.max_prompts_per_request or None,
            tool_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            default_seed=args.seed,
            metrics_prefix=prefix,
            sampling_defaults=defaults,
            max_logprobs=args.max_logprobs,
            log_requests=args.log_requests,
            **http_options,
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
    grace = args.graceful_shutdown_timeout
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level or args.log_level,
            access_log=args.access_log,
            root_path=args.root_path,
            # The drain below already waited for the requests; this only bounds
            # writing out the cut ones' last bytes.
            timeout_graceful_shutdown=min(grace, FLUSH_TIMEOUT_S),
        ),
        drain=lambda: async_engine.shutdown(drain_timeout_s=grace),
    )
    server.run()
    if server.started:
        return 0
    return 1


class _Server(uvicorn.Server):
    """uvicorn's server with kvserve's graceful shutdown. On the first SIGTERM/SIGINT:
    the listening sockets close (no new connection), the engine refuses new requests
    (503), ``drain()`` lets in-flight requests finish for up to the grace period and
    cuts the rest (an error event then ``[DONE]`` on streams, a JSON 503 otherwise),
    and uvicorn exits as soon as that is done — at once when nothing was in flight.
    A second signal exits without waiting. The signal is not re-raised afterwards
    (uvicorn re-raises it, which turns a clean shutdown into exit status -15)."""

    def __init__(
        self, config: uvicorn.Config, *, drain: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._exit_requested = False
        self._drain_task: asyncio.Future[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is None or self._exit_requested:
            self.should_exit = True
            return
        self._exit_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self._exit_requested and self._drain_task is None and self._drain is not None:
            logger.info("shutting down: no new requests; draining in-flight ones")
            for listener in getattr(self, "servers", []):
                listener.close()
            self._drain_task = asyncio.ensure_future(self._drain())
        if self._drain_task is not None and self._drain_task.done():
            self.should_exit = True
        return await super().on_tick(counter)

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
