"""``kvserve bench step-cost``: how well the step-time cost model predicts real steps.

Runs an engine in this process (``kvserve serve``'s engine, same options) on a preset
workload with Poisson arrivals in wall-clock time, and for every step compares the
time the cost model predicted (:mod:`kvserve.sched.cost_model`, fitted at startup and
corrected online) with the measured one. Prints the distribution of the relative
error ``(predicted - measured) / measured`` overall and by kind of step (decode only,
mixed, prefill only), and how long the steps that ran decodes took against
``--max-step-ms``. A benchmark, not a test: nothing here asserts. Bounded by
``--max-seconds``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from kvserve.engine.args import add_engine_arguments, engine_kwargs_from_args

KINDS = ("decode", "mixed", "prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=("chat-interference", "chat-multiturn", "random"),
        default="chat-interference",
        help="workload (default: %(default)s)",
    )
    parser.add_argument("--num-requests", type=int, default=28, help="requests (default: 28)")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=3.0,
        help="Poisson arrivals per second, or inf (default: 3)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-seconds", type=float, default=300.0, help="stop after this long (default: 300)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    add_engine_arguments(parser)


def _pct(values: list[float], q: float) -> float:
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
        "median_abs_error": _pct(absolute, 0.5),
        "p90_abs_error": _pct(absolute, 0.9),
        "mean_signed_error": statistics.fmean(rel),
        "within_15pct": sum(1 for e in absolute if e <= 0.15) / len(absolute),
        "median_measured_ms": _pct([r["measured_ms"] for r in records], 0.5),
    }


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.workloads import (
        WordVocabulary,
        WorkloadSpec,
        arrival_times,
        build_workload,
        render_prompt,
    )
    from kvserve.engine.args import build_engine_config
    from kvserve.engine.engine_core import EngineCore
    from kvserve.request import SamplingParams

    try:
        config = build_engine_config(**engine_kwargs_from_args(args))
        spec = WorkloadSpec(
            kind=args.workload,
            num_requests=args.num_requests,
            seed=args.seed,
            input_len=512,
            output_len=128,
            turns=5,
        )
        spec.validate()
    except (TypeError, ValueError) as e:
        print(f"kvserve bench step-cost: {e}", file=sys.stderr)
        return 2
    if not config.scheduler.max_step_ms:
        print(
            "kvserve bench step-cost: needs a step-time budget (--max-step-ms > 0)", file=sys.stderr
        )
        return 2
    t_start = time.perf_counter()
    engine = EngineCore(config)
    startup_s = time.perf_counter() - t_start
    model = engine.scheduler.cost_model
    if model is None:
        print("kvserve bench step-cost: the engine has no cost model", file=sys.stderr)
        return 2
    vocab = WordVocabulary.from_tokenizer(engine.tokenizer)
    workload = build_workload(spec, vocab)
    prompts = [
        (engine.tokenizer.encode(render_prompt(s, 0, [])), s.turns[0].output_len, s.tag)
        for s in workload.sessions
    ]
    arrivals = arrival_times(len(prompts), args.request_rate, seed=args.seed)

    sched = engine.scheduler
    last: list[Any] = [None]
    original = sched.schedule

    def schedule() -> Any:
        last[0] = original()
        return last[0]

    sched.schedule = schedule  # type: ignore[method-assign]
    records: list[dict[str, Any]] = []
    target = config.scheduler.max_step_ms
    t0 = time.perf_counter()
    added = 0
    while added < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        if now > args.max_seconds:
            print(f"stopped after {args.max_seconds:.0f} s", file=sys.stderr)
            break
        while added < len(prompts) and arrivals[added] <= now:
            ids, max_tokens, _ = prompts[added]
            engine.add_request(
                ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            )
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.05, arrivals[added] - now)))
            continue
        before = len(model.errors)
        engine.step()
        so = last[0]
        if so is None or so.is_empty or len(model.errors) == before:
            continue
        predicted, measured = model.errors[-1]
        rows = so.num_scheduled_tokens
        decodes = sum(1 for n in rows.values() if n == 1)
        kind = "decode" if decodes == len(rows) else ("prefill" if decodes == 0 else "mixed")
        records.append(
            {
                "kind": kind,
                "tokens": so.total_num_scheduled_tokens,
                "num_decodes": decodes,
                "predicted_ms": predicted,
                "measured_ms": measured,
            }
        )
    with_decodes = [r["measured_ms"] for r in records if r["num_decodes"]]
    result = {
        "config": {
            "max_step_ms": target,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "dtype": engine.loaded.dtype_name,
            "workload": args.workload,
            "num_requests": len(prompts),
            "request_rate": args.request_rate,
        },
        "startup_s": startup_s,
        "model": model.describe(),
        "all": summarize_errors(records),
        "by_kind": {k: summarize_errors([r for r in records if r["kind"] == k]) for k in KINDS},
        "steps_with_decodes_ms": (
            {
                "p50": _pct(with_decodes, 0.5),
                "p90": _pct(with_decodes, 0.9),
                "p99": _pct(with_decodes, 0.99),
                "share_over_target_plus_15pct": sum(1 for m in with_decodes if m > 1.15 * target)
                / len(with_decodes),
            }
            if with_decodes
            else {}
        ),
        "steps": records,
    }
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def format_result(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"step-time model, {cfg['workload']} ({cfg['num_requests']} requests at "
        f"{cfg['request_rate']} req/s), {cfg['dtype']}, max_step_ms={cfg['max_step_ms']}, "
        f"max_num_batched_tokens={cfg['max_num_batched_tokens']}",
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
    return "\n".join(lines)
