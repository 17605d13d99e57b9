"""Per-request timings and the figures computed from them.

Every time is in seconds since the benchmark started (``time.perf_counter`` based).
Definitions (the same as vLLM's ``benchmark_serving``):

    send_time            chunk_times[0]      chunk_times[1] ...  chunk_times[-1]  end_time
        |------- TTFT -------|---- ITL[0] ----|        ...         |               |
        |-------------------------------- E2E ------------------------------------|

- TTFT = first output chunk - send time.
- ITL = gaps between consecutive output chunks (one sample per gap; a server that
  sends several tokens in one chunk yields fewer, longer gaps).
- TPOT = (E2E - TTFT) / (num_output_tokens - 1), for requests with more than one
  output token; a one-token request counts as TPOT 0 for goodput only.
- Goodput = requests per second that met every SLO that was set.
- Percentiles interpolate linearly between samples (numpy's default).

Only successful requests enter the latency figures. Results that were not streamed
(``streamed=False``, the HF static-batching baseline) have no TPOT or ITL.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    """What the load generator saw of one request.

    ``num_output_tokens``/``num_prompt_tokens``/``num_cached_tokens`` come from the
    server's ``usage`` when it sends one; when ``num_output_tokens`` is None the
    number of output chunks stands in for it (see :attr:`output_tokens`).
    """

    session_id: int
    turn: int
    prompt_len: int
    output_len: int
    send_time: float
    tag: str = "default"
    chunk_times: list[float] = field(default_factory=list)
    end_time: float = math.nan
    success: bool = False
    error: str = ""
    num_output_tokens: int | None = None
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    generated_text: str = ""
    streamed: bool = True

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first output chunk (NaN when none came)."""
        return self.chunk_times[0] - self.send_time if self.chunk_times else math.nan

    @property
    def e2e(self) -> float:
        """Seconds from sending to the end of the response."""
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output chunks, in seconds."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def output_tokens(self) -> int:
        """Output tokens per usage, else the number of output chunks."""
        return (
            self.num_output_tokens if self.num_output_tokens is not None else len(self.chunk_times)
        )

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than two output tokens."""
        n = self.output_tokens
        if n < 2 or not self.chunk_times:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ttft"] = None if math.isnan(self.ttft) else self.ttft
        d["e2e"] = None if math.isnan(self.e2e) else self.e2e
        d["end_time"] = None if math.isnan(self.end_time) else self.end_time
        return d


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None means "not set"."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def validate(self) -> None:
        for name, value in (
            ("slo_ttft", self.ttft_ms),
            ("slo_tpot", self.tpot_ms),
            ("slo_e2e", self.e2e_ms),
        ):
            if value is not None and not value > 0:
                raise ValueError(
                    f"invalid {name}={value!r}: must be a positive number of milliseconds "
                    f"(for example: --{name.replace('_', '-')} 500)"
                )

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met_by(self, result: RequestResult) -> bool:
        """True when a successful ``result`` meets every SLO that is set."""
        if not result.success:
            return False
        if self.ttft_ms is not None and not result.ttft * 1000 <= self.ttft_ms:
            return False
        tpot = result.tpot or 0.0  # one output token: no decode, counts as 0 (as vLLM)
        if self.tpot_ms is not None and not tpot * 1000 <= self.tpot_ms:
            return False
        return not (self.e2e_ms is not None and not result.e2e * 1000 <= self.e2e_ms)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None when empty."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def distribution_ms(name: str, values_s: list[float]) -> dict[str, float | None]:
    """``mean_<name>_ms``, ``median_``, ``p90_``, ``p99_`` of seconds ``values_s``."""
    ms = [v * 1000.0 for v in values_s]
    return {
        f"mean_{name}_ms": mean(ms),
        f"median_{name}_ms": percentile(ms, 50),
        f"p90_{name}_ms": percentile(ms, 90),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def summarize(
    results: list[RequestResult], duration_s: float, slo: SLO | None = None
) -> dict[str, Any]:
    """The benchmark's figures from its request results.

    ``duration_s`` is the wall time the throughputs divide by (first send to last end).
    Returns a flat JSON-ready dict; latency keys are in milliseconds, throughputs per
    second, figures over no samples are None.
    """
    slo = slo or SLO()
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    streamed = [r for r in ok if r.streamed]
    total_out = sum(r.output_tokens for r in ok)
    total_in = sum(
        r.num_prompt_tokens if r.num_prompt_tokens is not None else r.prompt_len for r in ok
    )
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }
    summary.update(distribution_ms("ttft", [r.ttft for r in ok if r.chunk_times]))
    summary.update(distribution_ms("tpot", [t for r in streamed if (t := r.tpot) is not None]))
    summary.update(distribution_ms("itl", [g for r in streamed for g in r.itls]))
    summary.update(distribution_ms("e2e", [r.e2e for r in ok]))
    good = sum(1 for r in ok if slo.met_by(r)) if slo.is_set else None
    summary["slo"] = asdict(slo)
    summary["good_requests"] = good
    summary["goodput"] = per_s(good) if good is not None else None
    with_usage = [r for r in ok if r.num_cached_tokens is not None and r.num_prompt_tokens]
    prompt_with_usage = sum(r.num_prompt_tokens or 0 for r in with_usage)
    summary["client_cached_tokens"] = (
        sum(r.num_cached_tokens or 0 for r in with_usage) if with_usage else None
    )
    summary["client_cache_hit_rate"] = (
        summary["client_cached_tokens"] / prompt_with_usage
        if with_usage and prompt_with_usage
        else None
    )
    summary["errors"] = dict(Counter(r.error for r in failed).most_common())
    return summary


def summarize_by_tag(
    results: list[RequestResult], duration_s: float, slo: SLO | None = None
) -> dict[str, dict[str, Any]]:
    """:func:`summarize` per ``tag`` (empty when every result has the same tag)."""
    tags = sorted({r.tag for r in results})
    if len(tags) < 2:
        return {}
    return {t: summarize([r for r in results if r.tag == t], duration_s, slo) for t in tags}


def token_timeline(
    results: list[RequestResult], bin_s: float, end_s: float | None = None
) -> tuple[list[float], list[float]]:
    """Output tokens per second in bins of ``bin_s`` seconds from t=0.

    Each successful request's ``output_tokens`` are spread evenly over its chunks (a
    chunk may carry several tokens). Returns (bin start times, tokens per second).
    """
    if not bin_s > 0:
        raise ValueError(f"invalid bin_s={bin_s!r}: must be > 0 (for example: 0.5)")
    events: list[tuple[float, float]] = []
    for r in results:
        if r.success and r.chunk_times:
            per_chunk = r.output_tokens / len(r.chunk_times)
            events.extend((t, per_chunk) for t in r.chunk_times)
    last = max([t for t, _ in events], default=0.0)
    end = max(end_s or 0.0, last)
    num_bins = max(1, math.floor(end / bin_s) + 1)
    counts = [0.0] * num_bins
    for t, n in events:
        counts[min(num_bins - 1, max(0, math.floor(t / bin_s)))] += n
    return [i * bin_s for i in range(num_bins)], [c / bin_s for c in counts]


# Counter names of prefix-cache queries/hits (in tokens) across servers, without the
# "_total" suffix that prometheus_client's parser may or may not keep.
PREFIX_CACHE_COUNTERS: tuple[tuple[str, str], ...] = (
    ("kvserve:prefix_cache_queries", "kvserve:prefix_cache_hits"),
    ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"),
    ("vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits"),
)


def parse_prefix_cache_counters(metrics_text: str) -> dict[str, Any] | None:
    """Prefix-cache (queries, hits) from a Prometheus text exposition.

    Sums samples over all label sets (e.g. one per model). Returns
    ``{"source": name, "queries": q, "hits": h}`` for the first known counter pair
    present, None when the server exposes none of them. Raises ValueError when the
    text is not Prometheus format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                name = sample.name.removesuffix("_total")
                if sample.name.endswith(("_created", "_bucket", "_sum", "_count")):
                    continue
                totals[name] = totals.get(name, 0.0) + float(sample.value)
    except Exception as e:  # the parser raises bare ValueError/TypeError/KeyError
        raise ValueError(f"could not parse /metrics as Prometheus text: {e}") from e
    for queries, hits in PREFIX_CACHE_COUNTERS:
        if queries in totals and hits in totals:
            return {"source": queries, "queries": totals[queries], "hits": totals[hits]}
    return None


def prefix_cache_delta(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Hit rate over the run from two :func:`parse_prefix_cache_counters` readings.

    None when either reading is missing or they come from different counters.
    ``hit_rate`` is None when no queries happened during the run.
    """
    if before is None or after is None or before["source"] != after["source"]:
        return None
    queries = after["queries"] - before["queries"]
    hits = after["hits"] - before["hits"]
    return {
        "source": after["source"],
        "queries": queries,
        "hits": hits,
        "hit_rate": hits / queries if queries > 0 else None,
    }
