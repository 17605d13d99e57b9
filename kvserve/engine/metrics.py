"""Prometheus collectors for one engine, on the engine's own ``CollectorRegistry``.

Names follow vLLM's with the prefix ``kvserve:`` (``vllm:prompt_tokens`` becomes
``kvserve:prompt_tokens``; prometheus-client appends ``_total`` to counters and
``_bucket``/``_sum``/``_count`` to histograms in the text format). Every series
carries the label ``model_name``.

Two kinds of series:
- **Events** recorded as they happen (counters and histograms): prompt and
  generation tokens, finished requests by reason, rejected requests, time to first
  token, inter-token latency, end-to-end latency.
- **Engine state** read at scrape time from a snapshot of ``EngineCore.stats()``
  that the engine thread refreshes after every step (``set_stats_source``): running
  and waiting requests, KV cache usage, active / reclaimable / empty blocks, prefix
  cache queries and hits, preemptions, padding tokens, scheduler state, and the
  speculative-decoding counters (vLLM's ``spec_decode_num_drafts``,
  ``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._per_pos``).

Rules a caller must keep: the stats source must be cheap and thread-safe (it is
called on the scrape thread); it returns an :class:`~kvserve.engine.outputs.EngineStats`.
Nothing here is process-global, so several engines can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvserve.engine.outputs import EngineStats
from kvserve.kv_transfer.stats import TRANSFER_SECONDS_BUCKETS, TransferSnapshot

PREFIX = "kvserve:"

# vLLM's buckets (seconds).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# EngineStats field -> (metric name without prefix, help). Gauges are point-in-time values.
_GAUGES: dict[str, tuple[str, str]] = {
    "num_requests_running": ("num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": (
        "num_requests_waiting",
        "Requests waiting to be scheduled (those waiting for remote KV included).",
    ),
    "num_requests_waiting_for_remote_kv": (
        "num_requests_waiting_for_remote_kv",
        "Requests whose prompt KV is arriving from a prefill worker (decode role).",
    ),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "KV cache usage (0 to 1; 1 = full)."),
    "num_active_blocks": ("num_active_blocks", "KV blocks held by live requests."),
    "num_reclaimable_blocks": (
        "num_reclaimable_blocks",
        "Free KV blocks that still hold a cached prefix (evictable).",
    ),
    "num_empty_blocks": ("num_empty_blocks", "Free KV blocks holding nothing."),
    "step_predicted_ms": (
        "step_predicted_ms",
        "The last step's time predicted by the step-time cost model (ms).",
    ),
    "step_measured_ms": ("step_measured_ms", "The last step's measured time (ms)."),
    "step_time_abs_error": (
        "step_time_abs_error",
        "Cost model: moving mean of |predicted - measured| / measured step time.",
    ),
    "kv_offload_disk_bytes": ("kv_offload_disk_bytes", "KV offload tier: bytes of block files."),
    "kv_offload_files": ("kv_offload_files", "KV offload tier: block files on disk."),
}
# EngineStats field -> (metric name without prefix, help). Cumulative counts since start.
_COUNTERS: dict[str, tuple[str, str]] = {
    "prefix_cache_queries": (
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("num_preemptions", "Requests preempted to free KV blocks."),
    "total_padding_tokens": (
        "total_padding_tokens",
        "Padding tokens computed by the model (bucketed batches).",
    ),
    "num_failed_steps": ("num_failed_steps", "Engine steps whose model execution failed."),
    "spec_decode_num_drafts": (
        "spec_decode_num_drafts",
        "Speculative decoding: proposals verified (one per request and step).",
    ),
    "spec_decode_num_draft_tokens": (
        "spec_decode_num_draft_tokens",
        "Speculative decoding: draft tokens verified.",
    ),
    "spec_decode_num_accepted_tokens": (
        "spec_decode_num_accepted_tokens",
        "Speculative decoding: draft tokens accepted.",
    ),
    "kv_offload_hits": (
        "kv_offload_hits",
        "KV offload tier: blocks loaded back into the KV cache on a prefix hit.",
    ),
    "kv_offload_bytes_read": ("kv_offload_bytes_read", "KV offload tier: bytes read from disk."),
    "kv_offload_bytes_written": (
        "kv_offload_bytes_written",
        "KV offload tier: bytes written to disk.",
    ),
    "kv_offload_read_seconds": (
        "kv_offload_read_seconds",
        "KV offload tier: seconds spent reading and checking block files "
        "(divide by kv_offload_reads for the mean read latency).",
    ),
    "kv_offload_reads": ("kv_offload_reads", "KV offload tier: block files read and accepted."),
    "kv_offload_errors": (
        "kv_offload_errors",
        "KV offload tier: block files skipped (corrupt, truncated, another model's).",
    ),
    "kv_offload_writes_dropped": (
        "kv_offload_writes_dropped",
        "KV offload tier: blocks not written (write queue full or write failed).",
    ),
}


class _EngineStateCollector(Collector):
    """Turns the latest ``EngineCore.stats()`` snapshot into metric families."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.source: Callable[[], EngineStats] | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.source() if self.source is not None else None
        labels = ["model_name"]
        for key, (name, doc) in _GAUGES.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            if stats is not None:
                family.add_metric([self.model_name], float(getattr(stats, key)))
            yield family
        for key, (name, doc) in _COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            if stats is not None:
                counter.add_metric([self.model_name], float(getattr(stats, key)))
            yield counter
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted at each draft position (0 = first).",
            labels=["model_name", "position"],
        )
        if stats is not None:
            for pos, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([self.model_name, str(pos)], float(n))
        yield per_pos
        state = GaugeMetricFamily(
            PREFIX + "scheduler_state",
            "Scheduler state (1 for the current one), e.g. IDLE, ACTIVE_PREFILL, ACTIVE_DECODE.",
            labels=["model_name", "state"],
        )
        if stats is not None:
            state.add_metric([self.model_name, stats.scheduler_state], 1.0)
        yield state

    def describe(self) -> Iterator[Metric]:
        # Without describe() the registry would call collect() at registration.
        return iter(())


class _TransferCollector(Collector):
    """``kv_transfer_*`` series from a connector's :class:`TransferSnapshot` (absent
    on a single-process engine)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.source: Callable[[], TransferSnapshot] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        s = self.source()
        m = [self.model_name]
        by_dir = CounterMetricFamily(
            PREFIX + "kv_transfer_bytes",
            "KV bytes moved between workers.",
            labels=["model_name", "direction"],
        )
        by_dir.add_metric([*m, "sent"], float(s.bytes_sent))
        by_dir.add_metric([*m, "received"], float(s.bytes_received))
        yield by_dir
        blocks = CounterMetricFamily(
            PREFIX + "kv_transfer_blocks",
            "KV blocks moved between workers.",
            labels=["model_name", "direction"],
        )
        blocks.add_metric([*m, "sent"], float(s.blocks_sent))
        blocks.add_metric([*m, "received"], float(s.blocks_received))
        yield blocks
        failures = CounterMetricFamily(
            PREFIX + "kv_transfer_failures",
            "Remote prefills that failed (peer unreachable, silent, refused, bad hash).",
            labels=["model_name"],
        )
        failures.add_metric(m, float(s.failures))
        yield failures
        hist = HistogramMetricFamily(
            PREFIX + "kv_transfer_seconds",
            "Per remote prefill: seconds from the request to its last block loaded.",
            labels=["model_name"],
        )
        cum, buckets = 0, []
        for bound, count in zip(
            (*TRANSFER_SECONDS_BUCKETS, float("inf")), s.seconds_buckets, strict=True
        ):
            cum += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", float(cum)))
        hist.add_metric(m, buckets, s.seconds_sum)
        yield hist
        for name, value, doc in (
            ("kv_transfer_busy_seconds", s.busy_seconds, "Seconds the link carried KV chunks."),
            (
                "kv_transfer_long_busy_seconds",
                s.long_busy_seconds,
                "The same for prompts >= 2048 tokens.",
            ),
            (
                "kv_transfer_long_exposed_seconds",
                s.long_exposed_seconds,
                "Of that, seconds after the prompt's last prefill step (not hidden).",
            ),
            ("kv_transfer_long_prompts", float(s.num_long), "Remote prefills of >= 2048 tokens."),
        ):
            fam = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            fam.add_metric(m, value)
            yield fam
        nominal = GaugeMetricFamily(
            PREFIX + "kv_transfer_nominal_bytes_per_token",
            "KV bytes per token: 2 x layers x KV heads x head dim x dtype bytes.",
            labels=["model_name"],
        )
        nominal.add_metric(m, float(s.nominal_bytes_per_token))
        yield nominal
        in_flight = GaugeMetricFamily(
            PREFIX + "kv_transfer_in_flight",
            "Remote prefills this decode worker waits on (asked for, KV not all loaded).",
            labels=["model_name"],
        )
        in_flight.add_metric(m, float(s.in_flight))
        yield in_flight

    def describe(self) -> Iterator[Metric]:
        return iter(())


class EngineMetrics:
    """All Prometheus series of one engine (see the module docstring for names).

    The ``observe_*`` / ``count_*`` methods are thread-safe (prometheus-client
    locks internally) and are called by the async engine's thread.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        label = ["model_name"]
        reg = self.registry
        self._prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed.", label, registry=reg
        ).labels(model_name)
        self._generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", label, registry=reg
        ).labels(model_name)
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self._request_rejected = Counter(
            PREFIX + "num_requests_rejected",
            "Requests refused with 503 because the waiting queue was full.",
            label,
            registry=reg,
        ).labels(model_name)

        def latency(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=reg).labels(
                model_name
            )

        self._ttft = latency(
            "time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self._itl = latency(
            "inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of one request.",
            ITL_BUCKETS,
        )
        self._e2e = latency(
            "e2e_request_latency_seconds",
            "Seconds from arrival to the end of a request.",
            E2E_BUCKETS,
        )
        self._prompt_by_source = Counter(
            PREFIX + "prompt_tokens_by_source",
            "Prompt tokens by where their KV came from: local_compute, local_cache_hit "
            "or external_kv_transfer.",
            ["model_name", "source"],
            registry=reg,
        )
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            self._prompt_by_source.labels(model_name, source)
        self._state = _EngineStateCollector(model_name)
        reg.register(self._state)
        self._transfer = _TransferCollector(model_name)
        reg.register(self._transfer)

    def set_transfer_source(self, source: Callable[[], TransferSnapshot]) -> None:
        """Where the ``kv_transfer_*`` series come from (a KV connector's stats)."""
        self._transfer.source = source

    def count_prompt_tokens_by_source(
        self, *, local_compute: int, local_cache_hit: int, external_kv_transfer: int
    ) -> None:
        for source, n in (
            ("local_compute", local_compute),
            ("local_cache_hit", local_cache_hit),
            ("external_kv_transfer", external_kv_transfer),
        ):
            if n > 0:
                self._prompt_by_source.labels(self.model_name, source).inc(n)

    def set_stats_source(self, source: Callable[[], EngineStats]) -> None:
        """Where engine-state series come from at scrape time (``EngineCore.stats()``)."""
        self._state.source = source

    # ------------------------------------------------------------------ events
    def count_prompt_tokens(self, n: int) -> None:
        self._prompt_tokens.inc(n)

    def count_generation_tokens(self, n: int) -> None:
        self._generation_tokens.inc(n)

    def count_finished(self, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, finish_reason).inc()

    def count_rejected(self) -> None:
        self._request_rejected.inc()

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(max(seconds, 0.0))

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(max(seconds, 0.0))

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.observe(max(seconds, 0.0))

    # ------------------------------------------------------------------ export
    def render(self) -> bytes:
        """The registry in Prometheus text format (content type ``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
