"""Draft-model speculation A/B, offline: bf16 target (``--quantization none``), the
shipped Q4_1 file as draft, spec-edit prompts, concurrency 1 and 4, runs interleaved
(base, spec, base, spec, ...; shared machines: compare the ratios within one run).

    PYTHONPATH=. python benchmarks/spec_draft_ab.py --temperature 0.2 --reps 3

Prints per (concurrency, mode) the median output tok/s and median TTFT, the ratio
spec/base (wall clock, and output tokens per second of process CPU time: with one
torch thread on a loaded machine the CPU-time ratio is the steadier one), the acceptance per position, and where the spec engine's time went
(target forward, sampling, draft forwards by kind) from wrapped methods.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from kvserve.bench.spec_workloads import build_spec_sessions, first_turn_prompts
from kvserve.bench.timing import wrap_attr
from kvserve.engine.args import build_engine_config
from kvserve.engine.engine_core import EngineCore
from kvserve.model.loader import load_model
from kvserve.request import SamplingParams

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def wrap(obj: Any, name: str, label: str) -> None:
    wrap_attr(obj, name, TIMES, label, clock=time.perf_counter, counts=COUNTS)


def run_once(
    engine: EngineCore, prompts: list[list[int]], params: SamplingParams, tag: str
) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    c0 = time.process_time()
    first: dict[str, float] = {}
    ntok = 0
    ids = [engine.add_request(p, params, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    for _ in range(20000):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            if d.new_token_ids and d.request_id not in first:
                first[d.request_id] = time.perf_counter() - t0
            ntok += len(d.new_token_ids)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    engine.check_no_leaks()
    assert len(first) == len(ids)
    return ntok / wall, statistics.median(first.values()), ntok / cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--temperature", type=float, default=0.2)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--adaptive", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--share-target-kv", type=int, default=1)
    ap.add_argument(
        "--method", default="draft_model", help="draft_model, or ngram (k from --k, lookup 4)"
    )
    ap.add_argument(
        "--quantization", default="none", help="the target's (ngram: auto = the 4-bit file)"
    )
    ap.add_argument("--batch-invariant", type=int, default=None, help="1/0; default: the engine's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(dtype="bfloat16", quantization=args.quantization)
    tok = loaded.tokenizer
    spec: dict[str, Any] = {
        "method": "draft_model",
        "model": "smollm2-135m-instruct",
        "num_speculative_tokens": args.k,
        "adaptive": bool(args.adaptive),
        "share_target_kv": bool(args.share_target_kv),
    }
    if args.method == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_max": 4,
            "adaptive": bool(args.adaptive),
        }
    common: dict[str, Any] = dict(
        dtype="bfloat16", quantization=args.quantization, max_model_len=1024
    )
    if args.batch_invariant is not None:
        common["batch_invariant"] = bool(args.batch_invariant)
    base = EngineCore(build_engine_config(**common), loaded=loaded)
    spec_engine = EngineCore(build_engine_config(speculative_config=spec, **common), loaded=loaded)
    runner: Any = spec_engine.runner  # the ModelRunner (the engine types it by its protocol)
    sd = runner.spec_decoder
    assert sd is not None
    prop = sd.proposer
    wrap(prop, "propose", "draft.propose")
    fwd: Any = getattr(prop, "_forward", None)

    def draft_forward(chunks: Any) -> Any:
        n = sum(len(c[1]) for c in chunks)
        label = (
            "draft.fwd.rows1"
            if n == len(chunks)
            else (
                "draft.fwd.catchup<=8"
                if max(len(c[1]) for c in chunks) <= 8
                else "draft.fwd.prefill"
            )
        )
        t0 = time.perf_counter()
        try:
            return fwd(chunks)
        finally:
            TIMES[label] += time.perf_counter() - t0
            COUNTS[label] += 1

    if fwd is not None:
        prop._forward = draft_forward
    wrap(runner.model, "forward", "target.model.forward")
    wrap(runner, "execute_model", "runner.execute_model")
    wrap(runner, "_propose", "runner._propose")
    wrap(runner, "_sample_verify", "runner._sample_verify")
    wrap(runner, "_sample", "runner._sample")
    rng = random.Random(0)
    results: dict[tuple[int, str], list[tuple[float, float, float]]] = defaultdict(list)
    conc = [int(c) for c in args.concurrency.split(",")]
    stats0 = spec_engine.scheduler.spec_stats.snapshot()
    for rep in range(args.reps):
        for c in conc:
            sessions = build_spec_sessions("spec-edit", c, args.input_len, args.max_tokens, 1, rng)
            prompts = first_turn_prompts(tok, sessions)
            params = SamplingParams(
                temperature=args.temperature,
                seed=1000 + rep,
                max_tokens=args.max_tokens,
                ignore_eos=True,
            )
            for mode, eng in (("base", base), ("spec", spec_engine)):
                results[(c, mode)].append(run_once(eng, prompts, params, f"{mode}{rep}c{c}"))
    out: dict[str, Any] = {}
    for c in conc:
        b = [r[0] for r in results[(c, "base")]]
        s = [r[0] for r in results[(c, "spec")]]
        tb = [r[1] for r in results[(c, "base")]]
        ts = [r[1] for r in results[(c, "spec")]]
        ratios = [y / x for x, y in zip(b, s, strict=True)]
        cb = [r[2] for r in results[(c, "base")]]
        cs = [r[2] for r in results[(c, "spec")]]
        cpu_ratios = [y / x for x, y in zip(cb, cs, strict=True)]
        out[f"c{c}"] = {
            "base_tok_s": round(statistics.median(b), 2),
            "spec_tok_s": round(statistics.median(s), 2),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratios": [round(r, 3) for r in ratios],
            "cpu_tok_s_base": round(statistics.median(cb), 2),
            "cpu_tok_s_spec": round(statistics.median(cs), 2),
            "cpu_ratio_median": round(statistics.median(cpu_ratios), 3),
            "cpu_ratios": [round(r, 3) for r in cpu_ratios],
            "ttft_base_s": round(statistics.median(tb), 3),
            "ttft_spec_s": round(statistics.median(ts), 3),
        }
    st = spec_engine.scheduler.spec_stats.snapshot()
    out["spec_stats"] = {k: v for k, v in st.items()}
    out["spec_stats_before"] = stats0
    out["times_s"] = {k: round(v, 3) for k, v in TIMES.items()}
    out["counts"] = dict(COUNTS)
    out["uses_target_kv"] = getattr(prop, "uses_target_kv", None)
    out["kv_rows_copied"] = getattr(prop, "kv_rows_copied", None)
    out["gain_buckets"] = {
        b: {
            "spec_rate": round(bk.spec.rate, 3),
            "spec_n": bk.spec.n,
            "plain_rate": round(bk.plain.rate, 3),
            "plain_n": bk.plain.n,
            "off_steps": bk.off_steps,
            "retry": bk.retry,
        }
        for b, bk in sorted(sd.gain._buckets.items())
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
