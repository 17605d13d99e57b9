"""The figures and text of ``kvserve bench step-cost``: relative-error summaries of
predicted against measured step times, vLLM bench's stream figures (tok/s, TTFT,
TPOT, ITL) from per-request token times, one configuration's report and the
comparison of variants (medians over rounds)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Stream figures printed per configuration, (key, label, format).
STREAM_FIGURES = (
    ("output_tok_s", "tok/s", "{:.1f}"),
    ("mean_ttft_ms", "mean TTFT ms", "{:.0f}"),
    ("mean_tpot_ms", "mean TPOT ms", "{:.1f}"),
    ("p50_itl_ms", "p50 ITL ms", "{:.1f}"),
    ("p99_itl_ms", "p99 ITL ms", "{:.0f}"),
    ("median_abs_error", "median |err|", "{:.1%}"),
    ("p90_abs_error", "p90 |err|", "{:.1%}"),
)


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank, no interpolation)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize_errors(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Relative-error figures of ``records`` (each with ``predicted_ms``/``measured_ms``)."""
    if not records:
        return {"steps": 0}
    rel = [(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in records]
    absolute = [abs(e) for e in rel]
    return {
        "steps": len(records),
        "median_abs_error": pct(absolute, 0.5),
        "p90_abs_error": pct(absolute, 0.9),
        "mean_signed_error": statistics.fmean(rel),
        "within_15pct": sum(1 for e in absolute if e <= 0.15) / len(absolute),
        "median_measured_ms": pct([r["measured_ms"] for r in records], 0.5),
    }


@dataclass
class RequestTimes:
    """When one request was added and when each of its tokens arrived (seconds)."""

    added: float
    tokens: list[float] = field(default_factory=list)
    num_tokens: int = 0


def stream_figures(times: Sequence[RequestTimes], duration_s: float) -> dict[str, float]:
    """vLLM bench's figures from per-request token times: output tok/s over
    ``duration_s``, mean TTFT, mean TPOT ((last - first) / (tokens - 1)), p50/p99 of
    the gaps between token arrivals (ITL). Requests without a token count for tok/s
    only (0 tokens)."""
    ttft = [t.tokens[0] - t.added for t in times if t.tokens]
    tpot = [
        (t.tokens[-1] - t.tokens[0]) / (t.num_tokens - 1)
        for t in times
        if t.tokens and t.num_tokens > 1
    ]
    itl = [b - a for t in times for a, b in zip(t.tokens, t.tokens[1:], strict=False)]
    out: dict[str, float] = {
        "output_tok_s": sum(t.num_tokens for t in times) / duration_s if duration_s > 0 else 0.0,
        "duration_s": duration_s,
    }
    if ttft:
        out["mean_ttft_ms"] = 1e3 * statistics.fmean(ttft)
    if tpot:
        out["mean_tpot_ms"] = 1e3 * statistics.fmean(tpot)
    if itl:
        out["p50_itl_ms"] = 1e3 * pct(itl, 0.5)
        out["p99_itl_ms"] = 1e3 * pct(itl, 0.99)
    return out


def _figure(res: dict[str, Any], key: str) -> float | None:
    if key in res["streams"]:
        return float(res["streams"][key])
    v = res["all"].get(key)
    return None if v is None else float(v)


def format_comparison(results: dict[str, list[dict[str, Any]]]) -> str:
    """Median over rounds of each figure, per variant (first variant = reference)."""
    names = list(results)
    lines = ["medians over rounds (ratio to " + names[0] + ")"]
    header = f"  {'figure':<14}" + "".join(f"{n:>22}" for n in names)
    lines.append(header)
    for key, label, fmt in STREAM_FIGURES:
        ref = None
        cells = []
        for j, n in enumerate(names):
            vals = [v for v in (_figure(r, key) for r in results[n]) if v is not None]
            if not vals:
                cells.append(f"{'-':>22}")
                continue
            med = statistics.median(vals)
            if j == 0:
                ref = med
            ratio = f" ({med / ref:.2f}x)" if ref and j and not math.isclose(ref, 0) else ""
            cells.append(f"{fmt.format(med) + ratio:>22}")
        lines.append(f"  {label:<14}" + "".join(cells))
    return "\n".join(lines)


def format_result(result: dict[str, Any], show_steps: int = 0) -> str:
    """One configuration's report; ``show_steps``: list that many of its slowest steps."""
    cfg = result["config"]
    lines = [
        f"{result.get('variant', '')} round {result.get('round', 1)}: {cfg['num_requests']} "
        f"requests at {cfg['request_rate']} req/s (concurrency {cfg['max_concurrency']}), "
        f"{cfg['dtype']}, max_step_ms={cfg['max_step_ms']}, "
        f"max_num_batched_tokens={cfg['max_num_batched_tokens']}"
        + (" [stopped early]" if result.get("stopped_early") else ""),
        f"  model: {result['model']}",
        "  kind      steps  median|err|  p90|err|  mean err  within 15%  median ms",
    ]
    for name, s in [("all", result["all"]), *result["by_kind"].items()]:
        if not s.get("steps"):
            lines.append(f"  {name:<8} {0:>6}")
            continue
        lines.append(
            f"  {name:<8} {s['steps']:>6}  {100 * s['median_abs_error']:>10.1f}%"
            f"  {100 * s['p90_abs_error']:>7.1f}%  {100 * s['mean_signed_error']:>+7.1f}%"
            f"  {100 * s['within_15pct']:>9.0f}%  {s['median_measured_ms']:>9.1f}"
        )
    d = result["steps_with_decodes_ms"]
    if d:
        lines.append(
            f"  steps with decodes: p50 {d['p50']:.0f} ms, p90 {d['p90']:.0f} ms, p99 "
            f"{d['p99']:.0f} ms; {100 * d['share_over_target_plus_15pct']:.0f}% over "
            f"1.15 x target"
        )
    s = result.get("streams", {})
    if s:
        lines.append(
            "  streams: "
            + ", ".join(
                f"{label} " + fmt.format(s[key]) for key, label, fmt in STREAM_FIGURES if key in s
            )
        )
    if "prompt_tokens_computed" in result:
        lines.append(
            f"  prompt tokens computed {100 * result['prompt_tokens_computed']:.1f}% of those "
            f"sent (prefix-cache hit rate {100 * result['prefix_cache_hit_rate']:.1f}%)"
        )
    slow = sorted(
        (r for r in result.get("steps", []) if r["num_decodes"]),
        key=lambda r: -r["measured_ms"],
    )[:show_steps]
    if slow:
        lines.append("  slowest steps with decodes (decodes x mean ctx | chunks new@ctx):")
    for r in slow:
        mean_ctx = r["decode_ctx_sum"] / max(1, r["num_decodes"])
        chunks = " ".join(f"{n}@{c}" for n, c in r["chunks"][:8])
        more = f" +{len(r['chunks']) - 8}" if len(r["chunks"]) > 8 else ""
        lines.append(
            f"    t={r['t']:.2f}s {r['measured_ms']:.0f} ms (pred {r['predicted_ms']:.0f}): "
            f"{r['num_decodes']} x {mean_ctx:.0f} | {chunks}{more}"
        )
    return "\n".join(lines)
