"""``--compile`` against eager, offline, one process per configuration (issue 10 item 3).

For each configuration: engine startup time (model load + KV allocation + compiling
and warming every decode bucket), then output tokens/s of ``--num-prompts`` random
prompts of ``--input-len`` tokens with ``--output-len`` greedy tokens at
``--max-num-seqs`` concurrency, and the median decode-only step. A benchmark, not a
test.

    .venv/bin/python benchmarks/compile_bench.py            # all four configurations
    .venv/bin/python benchmarks/compile_bench.py --one mixed-compiled
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

CONFIGS = {
    "mixed-eager": dict(scheduler_policy="mixed"),
    "mixed-compiled": dict(scheduler_policy="mixed", compile=True),
    "separated-eager": dict(scheduler_policy="separated", num_seqs_buckets=(8, 16)),
    "separated-compiled": dict(
        scheduler_policy="separated", num_seqs_buckets=(8, 16), compile=True
    ),
}


def run_one(name: str, args: argparse.Namespace) -> dict[str, float]:
    from kvserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=1024,
        **CONFIGS[name],  # type: ignore[arg-type]
    )
    startup = time.perf_counter() - t0
    rng = random.Random(1)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    step_times: list[float] = []
    orig = engine.step

    def timed_step():  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = orig()
        if out and all(len(d.new_token_ids) == 1 for d in out) and len(out) == args.max_num_seqs:
            step_times.append(time.perf_counter() - t)
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    t1 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    total = time.perf_counter() - t1
    return {
        "startup_s": startup,
        "output_tok_s": args.num_prompts * args.output_len / total,
        "full_decode_step_ms": statistics.median(step_times) * 1e3 if step_times else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", choices=list(CONFIGS))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    for name in CONFIGS:  # a fresh process each: compiled graphs and caches do not mix
        cmd = [sys.executable, __file__, "--one", name]
        for k in (
            "num_prompts",
            "input_len",
            "output_len",
            "max_num_seqs",
            "max_num_batched_tokens",
        ):
            cmd += ["--" + k.replace("_", "-"), str(getattr(args, k))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(
            f"{name:<20} startup {r['startup_s']:6.1f} s   output {r['output_tok_s']:6.1f} tok/s"
            f"   full decode step {r['full_decode_step_ms']:6.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
