"""results.json, plots and the printed summary of one benchmark run.

``results.json`` layout (all latencies in ms, throughputs per second)::

    {"kind": "serve", "created": ISO time,
     "config": {...load generator settings...},
     "workload": {"spec": {...}, "num_sessions", "num_requests", "exact_lengths", ...},
     "summary": {completed, failed, request_throughput, output_throughput,
                 mean/median/p90/p99 _ttft_ms _tpot_ms _itl_ms _e2e_ms,
                 goodput, good_requests, slo, prefix_cache_hit_rate,
                 client_cache_hit_rate, errors, ...},
     "by_tag": {tag: summary, ...}       # only when the workload has several tags
     "prefix_cache": {source, queries, hits, hit_rate} | null,
     "requests": [per-request timings, chunk_times included]}
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from kvserve.bench.metrics import SLO, RequestResult, summarize, summarize_by_tag
from kvserve.bench.plots import write_plots
from kvserve.bench.workloads import Workload


def build_report(
    results: list[RequestResult],
    duration_s: float,
    workload: Workload,
    slo: SLO,
    config: dict[str, Any],
    prefix_cache: dict[str, Any] | None,
    kind: str = "serve",
    spec_decode: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON-ready report of one run (layout in the module docstring)."""
    summary = summarize(results, duration_s, slo)
    summary["prefix_cache_hit_rate"] = prefix_cache["hit_rate"] if prefix_cache else None
    summary["spec_decode_acceptance_rate"] = spec_decode["acceptance_rate"] if spec_decode else None
    return {
        "kind": kind,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": config,
        "workload": workload.describe(),
        "summary": summary,
        "by_tag": summarize_by_tag(results, duration_s, slo),
        "prefix_cache": prefix_cache,
        "spec_decode": spec_decode,
        "requests": [r.to_json() for r in results],
    }


def write_report(
    report: dict[str, Any],
    results: list[RequestResult],
    out_dir: Path,
    plots: bool = True,
    title: str = "",
) -> list[Path]:
    """Write ``results.json`` (and the PNGs unless ``plots`` is False) into ``out_dir``,
    creating it. Returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(report, indent=1, allow_nan=False))
    written = [path]
    if plots:
        written += write_plots(results, out_dir, report["summary"]["duration_s"], title)
    return written


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_summary(report: dict[str, Any]) -> str:
    """A human-readable block of the main figures, as printed by ``kvserve bench serve``."""
    s = report["summary"]
    lines = [
        f"{'=' * 18} serving benchmark {'=' * 18}",
        f"{'successful requests:':<36}{s['completed']}",
        f"{'failed requests:':<36}{s['failed']}",
        f"{'duration (s):':<36}{_fmt(s['duration_s'])}",
        f"{'total input tokens:':<36}{s['total_input_tokens']}",
        f"{'total output tokens:':<36}{s['total_output_tokens']}",
        f"{'request throughput (req/s):':<36}{_fmt(s['request_throughput'])}",
        f"{'output token throughput (tok/s):':<36}{_fmt(s['output_throughput'])}",
        f"{'total token throughput (tok/s):':<36}{_fmt(s['total_token_throughput'])}",
    ]
    if s["goodput"] is not None:
        lines.append(
            f"{'goodput (req/s):':<36}{_fmt(s['goodput'])}  ({s['good_requests']} met the SLOs)"
        )
    if s["prefix_cache_hit_rate"] is not None:
        lines.append(
            f"{'prefix cache hit rate (server):':<36}{_fmt(100 * s['prefix_cache_hit_rate'], 1)}%"
        )
    spec = report.get("spec_decode")
    if spec and spec.get("draft_tokens"):
        lines.append(
            f"{'spec decode acceptance rate:':<36}{_fmt(100 * spec['acceptance_rate'], 1)}%"
            f"  (mean acceptance length {_fmt(spec['mean_acceptance_length'])})"
        )
        lines.append(
            f"{'spec decode drafts / tokens / acc.:':<36}{int(spec['drafts'])} / "
            f"{int(spec['draft_tokens'])} / {int(spec['accepted_tokens'])}"
        )
        per_pos = ", ".join(_fmt(x) for x in spec["acceptance_rate_per_pos"])
        lines.append(f"{'spec decode acceptance per position:':<36}{per_pos}")
    if s["client_cache_hit_rate"] is not None:
        lines.append(
            f"{'cached prompt tokens (usage):':<36}{_fmt(100 * s['client_cache_hit_rate'], 1)}%"
        )
    for name, label in (("ttft", "time to first token"), ("tpot", "time per output token"),
                        ("itl", "inter-token latency"), ("e2e", "end-to-end latency")):  # fmt: skip
        lines.append(f"{'-' * 14} {label} (ms) {'-' * 14}")
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(f"{stat + ':':<36}{_fmt(s[f'{stat}_{name}_ms'])}")
    for tag, ts in report.get("by_tag", {}).items():
        lines.append(
            f"[{tag}] completed {ts['completed']}, mean TTFT {_fmt(ts['mean_ttft_ms'])} ms, "
            f"p99 ITL {_fmt(ts['p99_itl_ms'])} ms, output {_fmt(ts['output_throughput'])} tok/s"
        )
    if s["errors"]:
        lines.append("errors:")
        lines.extend(f"  {count} x {msg}" for msg, count in s["errors"].items())
    lines.append("=" * 55)
    return "\n".join(lines)
