"""``kvserve serve``: the OpenAI-compatible server on uvicorn.

    kvserve serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY] [--max-queue-len N]
                  [--served-model-name NAME] [engine options: --model, --max-num-seqs, ...]
                  [--kv-role both|prefill|decode ...]   (docs/disaggregation.md)
                  [vLLM's flags: --seed, --generation-config, --enable-auto-tool-choice
                   --tool-call-parser hermes, --tensor-parallel-size 1, ... (serve_args)]

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
from types import FrameType

import uvicorn

from kvserve.engine.args import build_engine_config
from kvserve.engine.vllm_compat import generation_defaults
from kvserve.entrypoints.serve_args import (
    add_arguments,
    engine_options_from_args,
    http_options_from_args,
    metrics_prefix,
    uvicorn_limits_from_args,
)
from kvserve.kv_transfer.factory import build_connector, kv_transfer_config_from_args

__all__ = ["add_arguments", "http_options_from_args", "run"]

logger = logging.getLogger("kvserve.serve")


FLUSH_TIMEOUT_S = 5  # after the drain: time to write out the cut responses
GC_GEN0_THRESHOLD = 70_000  # allocations between young collections while serving


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
        or args.min_replicas is not None
        or args.max_replicas is not None
        or args.prefill_replicas is not None
        or args.decode_replicas is not None
    ):
        from kvserve.entrypoints.serve_replicas import run_replicas

        return run_replicas(args, api_key)
    if args.ingress_replicas != 1:
        print(
            "kvserve serve: --ingress-replicas needs --replicas N (or --min-replicas/"
            "--max-replicas, or --prefill-replicas/--decode-replicas): one process serves "
            "HTTP itself",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    try:
        http_options = http_options_from_args(args)
        uvicorn_limits = uvicorn_limits_from_args(args)
        options, notices = engine_options_from_args(args)
        for notice in notices:
            logger.info("%s", notice)
        prefix = metrics_prefix(args.metrics_prefix)
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
            open_metrics=bool(args.allow_unauthenticated_metrics),
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
    kv_pool = kv_pool_line(engine)
    if kv_pool:
        logger.info("%s", kv_pool)
    budget = step_budget_line(engine)
    if budget:
        logger.info("%s", budget)
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
            **uvicorn_limits,
        ),
        drain=lambda: async_engine.shutdown(drain_timeout_s=grace),
    )
    server.run()
    if server.started:
        return 0
    return 1


def kv_pool_line(engine: object) -> str | None:
    """One log line: how many tokens the KV pool can hold, its size, and how much of
    it is resident now (None when the runner has no KV tensor of its own)."""
    from kvserve.model.lazy_memory import resident_bytes

    runner = getattr(engine, "runner", None)
    kv = getattr(runner, "kv_cache", None)
    blocks = getattr(runner, "num_kv_blocks", None)
    block_size = getattr(runner, "block_size", None)
    if kv is None or not isinstance(blocks, int) or not isinstance(block_size, int):
        return None
    total = kv.numel() * kv.element_size()
    lazy = bool(getattr(runner, "kv_cache_lazy", False))
    resident = resident_bytes(kv) if lazy else total
    now = f"{resident / 2**20:.1f} MiB" if resident is not None else "unknown"
    return (
        f"KV cache pool: holds up to {(blocks - 1) * block_size} tokens ({blocks} blocks, "
        f"{total / 2**30:.2f} GiB {'ceiling, committed as used' if lazy else 'reserved'}); "
        f"resident now {now}"
    )


def step_budget_line(engine: object) -> str | None:
    """One log line: the step budget the scheduler runs with -- its token budget, the
    step-time targets and, where a step-time model is attached, the prompt tokens that
    fit beside decodes in one step by that model (what the start's calibration chose),
    and the model itself. None for an engine without a scheduler."""
    sched = getattr(engine, "scheduler", None)
    cfg = getattr(sched, "config", None)
    if sched is None or cfg is None:
        return None
    tokens = int(getattr(sched, "max_num_batched_tokens", cfg.max_num_batched_tokens))
    line = f"step budget: {tokens} tokens per step"
    model = getattr(sched, "cost_model", None)
    if model is None or not cfg.max_step_ms:
        return line + " (no step-time target)"
    step = float(cfg.max_step_ms)
    chunk = model.max_chunk(step, 0, tokens)
    line += f"; steps with decodes aim at {step:g} ms: up to {chunk} prompt tokens beside them"
    short = float(cfg.short_prompt_step_ms)
    if 0 < short < step:
        line += f" ({model.max_chunk(short, 0, tokens)} when only short prompts, {short:g} ms)"
    return f"{line}; step-time model {model.describe()}, scale {model.scale:.2f}"


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
