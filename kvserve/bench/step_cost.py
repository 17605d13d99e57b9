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
import random
import shlex
import sys
import time
from typing import Any

from kvserve.bench.step_cost_report import (
    RequestTimes,
    format_comparison,
    format_result,
    pct,
    stream_figures,
    summarize_errors,
)
from kvserve.engine.args import add_engine_arguments, engine_kwargs_from_args

KINDS = ("decode", "mixed", "prefill")
WORKLOADS = ("chat-interference", "chat-multiturn", "random", "shared-prefix")


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
                "p50": pct(with_decodes, 0.5),
                "p90": pct(with_decodes, 0.9),
                "p99": pct(with_decodes, 0.99),
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
