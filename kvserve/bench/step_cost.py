"""``kvserve bench step-cost``: how well the step-time cost model predicts real steps,
what every step held, and what the streams saw, for one or several configurations.

Runs engines in this process (``kvserve serve``'s engine, same options) on a workload
with arrivals in wall-clock time: Poisson at ``--request-rate`` (``inf``: all at once)
and at most ``--max-concurrency`` requests in flight (a closed loop, like vLLM's bench
client). For every step it compares the time the cost model predicted
(:mod:`kvserve.sched.cost_model`, fitted at startup and corrected online) with the
measured one, and records the step's rows (the trace: decode rows and their context,
prompt chunks as new tokens over context). Per configuration it prints the
distribution of the relative error ``(predicted - measured) / measured`` overall and
by kind of step (decode only, mixed, prefill only), the steps that ran decodes
against ``--max-step-ms``, the slowest such steps, and the streams' figures measured
at the engine (output tok/s, mean TTFT, mean TPOT, p50/p99 inter-token latency; no
HTTP or detokenizer time, so a server's figures are a little higher).

Workloads: the presets of :mod:`kvserve.bench.workloads` (``chat-interference``,
``chat-multiturn``: first turns only), ``random`` and ``shared-prefix`` built in token
space like vLLM's bench ``--dataset-name random`` / ``prefix_repetition`` (random token
ids; ``shared-prefix`` is ``--num-prefixes`` prefixes of ``--prefix-len`` tokens, each
prompt one of them plus ``--input-len`` unique tokens, shuffled), or ``--jsonl FILE``
(lines ``{"prompt", "output_tokens"}``, e.g. the peer harness's workloads), shuffled
with ``--seed`` as vLLM's custom dataset does unless ``--no-shuffle``.

A/B: ``--variant NAME=FLAGS`` (repeatable) runs each configuration (the base engine
options plus FLAGS) once per ``--rounds`` round, interleaved (the order alternates
every round), and prints each figure's median over rounds: compare ratios within one
run on a shared machine. A benchmark, not a test: nothing here asserts. Bounded by
``--max-seconds`` per run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.args import add_engine_arguments, engine_kwargs_from_args

KINDS = ("decode", "mixed", "prefill")
WORKLOADS = ("chat-interference", "chat-multiturn", "random", "shared-prefix")
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="chat-interference",
        help="workload (default: %(default)s; ignored with --jsonl)",
    )
    parser.add_argument(
        "--jsonl",
        default=None,
        help='replay this file of {"prompt", "output_tokens"} lines instead of a preset',
    )
    parser.add_argument(
        "--no-shuffle",
        action="store_true",
        help="send --jsonl / shared-prefix prompts in file order (default: shuffled by --seed)",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests (default: 32; with --jsonl every line)",
    )
    parser.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="random: prompt tokens (512); shared-prefix: unique tokens after the prefix (64)",
    )
    parser.add_argument(
        "--output-len", type=int, default=None, help="random: 128, shared-prefix: 64"
    )
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix (1024)")
    parser.add_argument("--num-prefixes", type=int, default=2, help="shared-prefix (2)")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=3.0,
        help="Poisson arrivals per second, or inf (default: 3)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight (default: no limit)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-seconds", type=float, default=300.0, help="stop a run after this long (300)"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a configuration to compare: the engine options given here plus FLAGS "
        '(e.g. --variant "b300=" --variant "b120=--max-step-ms 120"); repeatable',
    )
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default: 1)")
    parser.add_argument(
        "--show-steps", type=int, default=8, help="print this many slowest steps with decodes"
    )
    parser.add_argument("--json", default=None, help="also write the results (and traces) here")
    add_engine_arguments(parser)


def _pct(values: Sequence[float], q: float) -> float:
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
        out["p50_itl_ms"] = 1e3 * _pct(itl, 0.5)
        out["p99_itl_ms"] = 1e3 * _pct(itl, 0.99)
    return out


def build_prompts(args: argparse.Namespace, tokenizer: Any) -> list[tuple[list[int], int]]:
    """The workload as ``(prompt token ids, output tokens)`` in sending order."""
    rng = random.Random(args.seed)
    vocab_size = int(getattr(tokenizer, "vocab_size", 0) or 32000)
    low, high = 100, max(101, min(vocab_size, 49152) - 100)

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    if args.jsonl:
        with open(args.jsonl) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts = [(tokenizer.encode(r["prompt"]), int(r["output_tokens"])) for r in rows]
        if not args.no_shuffle:
            random.Random(args.seed).shuffle(prompts)
        return prompts[: args.num_requests] if args.num_requests else prompts
    num = args.num_requests or 32
    if args.workload == "random":
        n_in, n_out = args.input_len or 512, args.output_len or 128
        return [(ids(n_in), n_out) for _ in range(num)]
    if args.workload == "shared-prefix":
        n_in, n_out = args.input_len or 64, args.output_len or 64
        per = max(1, num // max(1, args.num_prefixes))
        prompts = []
        for _ in range(args.num_prefixes):
            prefix = ids(args.prefix_len)
            prompts += [(prefix + ids(n_in), n_out) for _ in range(per)]
        if not args.no_shuffle:
            rng.shuffle(prompts)
        return prompts
    from kvserve.bench.workloads import (
        WordVocabulary,
        WorkloadSpec,
        build_workload,
        render_prompt,
    )

    spec = WorkloadSpec(
        kind=args.workload,
        num_requests=num,
        seed=args.seed,
        input_len=args.input_len or 512,
        output_len=args.output_len or 128,
        turns=5,
    )
    workload = build_workload(spec, WordVocabulary.from_tokenizer(tokenizer))
    return [
        (tokenizer.encode(render_prompt(s, 0, [])), s.turns[0].output_len)
        for s in workload.sessions
    ]


def _step_record(so: Any, predicted: float, measured: float, t: float) -> dict[str, Any]:
    rows = so.num_scheduled_tokens
    ctx = so.cached_seq_len
    decodes = [ctx.get(r, 0) for r, n in rows.items() if n == 1]
    chunks = [(n, ctx.get(r, 0)) for r, n in rows.items() if n > 1]
    kind = "decode" if not chunks else ("prefill" if not decodes else "mixed")
    return {
        "t": t,
        "kind": kind,
        "tokens": so.total_num_scheduled_tokens,
        "num_decodes": len(decodes),
        "decode_ctx_sum": sum(decodes),
        "decode_ctx_max": max(decodes, default=0),
        "chunks": chunks,
        "predicted_ms": predicted,
        "measured_ms": measured,
    }


def run_once(config: Any, workload: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One engine on the workload (``workload["prompts"]``, built from the first
    engine's tokenizer); its figures, error summaries and step trace."""
    from kvserve.engine.engine_core import EngineCore
    from kvserve.request import SamplingParams

    t_start = time.perf_counter()
    engine = EngineCore(config)
    startup_s = time.perf_counter() - t_start
    model = engine.scheduler.cost_model
    if model is None:
        raise ValueError("the engine has no cost model (needs --max-step-ms > 0)")
    if "prompts" not in workload:
        workload["prompts"] = build_prompts(args, engine.tokenizer)
    prompts: list[tuple[list[int], int]] = workload["prompts"]
    # warm-up (first-touch allocations), not measured
    for ids, _ in prompts[:2]:
        engine.add_request(ids[:64], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # a fresh error history for this run (the online state stays warm)
    model.errors.clear()
    from kvserve.bench.workloads import arrival_times

    arrivals = arrival_times(len(prompts), args.request_rate, seed=args.seed)
    limit = args.max_concurrency or len(prompts)
    sched = engine.scheduler
    last: list[Any] = [None]
    original = sched.schedule

    def schedule() -> Any:
        last[0] = original()
        return last[0]

    sched.schedule = schedule  # type: ignore[method-assign]
    times: dict[str, RequestTimes] = {}
    in_flight: set[str] = set()
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    added = 0
    stopped = False
    try:
        while added < len(prompts) or engine.has_unfinished_requests():
            now = time.perf_counter() - t0
            if now > args.max_seconds:
                stopped = True
                break
            while added < len(prompts) and arrivals[added] <= now and len(in_flight) < limit:
                ids, max_tokens = prompts[added]
                rid = engine.add_request(
                    ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                )
                times[rid] = RequestTimes(added=time.perf_counter())
                in_flight.add(rid)
                added += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, min(0.05, arrivals[added] - now)))
                continue
            before = len(model.errors)
            deltas = engine.step()
            t_now = time.perf_counter()
            for d in deltas:
                rt = times.get(d.request_id)
                if rt is None:
                    continue
                if d.new_token_ids:
                    rt.tokens.append(t_now)
                    rt.num_tokens += len(d.new_token_ids)
                if d.finish_reason is not None:
                    in_flight.discard(d.request_id)
            so = last[0]
            if so is None or so.is_empty or len(model.errors) == before:
                continue
            predicted, measured = model.errors[-1]
            records.append(_step_record(so, predicted, measured, t_now - t0))
    finally:
        sched.schedule = original  # type: ignore[method-assign]
    duration = time.perf_counter() - t0
    target = config.scheduler.max_step_ms
    kv = engine.kv_cache_manager
    total_prompt = sum(len(p) for p, _ in prompts)
    computed = sum(n for r in records for n, _ in r["chunks"])
    with_decodes = [r["measured_ms"] for r in records if r["num_decodes"]]
    result = {
        "config": {
            "max_step_ms": target,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "dtype": engine.loaded.dtype_name,
            "num_requests": len(prompts),
            "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
        },
        "stopped_early": stopped,
        "startup_s": startup_s,
        "model": model.describe(),
        "streams": stream_figures(list(times.values()), duration),
        "prefix_cache_hit_rate": (
            kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else 0.0
        ),
        # prompt tokens computed in chunks of 2+ tokens / all prompt tokens sent
        "prompt_tokens_computed": computed / total_prompt if total_prompt else 0.0,
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
    del engine
    gc.collect()
    return result


def _parse_variants(specs: list[str]) -> list[tuple[str, list[str]]]:
    out = []
    for s in specs or ["default="]:
        name, sep, flags = s.partition("=")
        if not sep or not name:
            raise ValueError(
                f"invalid --variant {s!r}: use NAME=FLAGS (for example b120=--max-step-ms 120)"
            )
        out.append((name, shlex.split(flags)))
    return out


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.args import build_engine_config

    try:
        variants = _parse_variants(args.variant)
        configs = []
        for name, flags in variants:
            parser = argparse.ArgumentParser(prog=f"--variant {name}")
            add_engine_arguments(parser)
            extra = engine_kwargs_from_args(parser.parse_args(flags))
            config = build_engine_config(**{**engine_kwargs_from_args(args), **extra})
            if not config.scheduler.max_step_ms:
                raise ValueError(f"variant {name}: needs a step-time budget (--max-step-ms > 0)")
            configs.append(config)
        if args.rounds < 1:
            raise ValueError(f"invalid --rounds {args.rounds}: must be >= 1 (for example 3)")
    except (TypeError, ValueError, SystemExit) as e:
        print(f"kvserve bench step-cost: {e}", file=sys.stderr)
        return 2
    workload: dict[str, Any] = {}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    for r in range(args.rounds):
        order = list(range(len(variants)))
        if r % 2:
            order.reverse()
        for i in order:
            name = variants[i][0]
            print(f"[step-cost] round {r + 1} {name} ...", file=sys.stderr, flush=True)
            res = run_once(configs[i], workload, args)
            res["variant"] = name
            res["round"] = r + 1
            results[name].append(res)
            print(format_result(res, args.show_steps), flush=True)
    if len(variants) > 1 or args.rounds > 1:
        print(format_comparison(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.jsonl or args.workload, "results": results}, f, indent=1)
    return 0


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
