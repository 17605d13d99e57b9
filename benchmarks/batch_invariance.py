"""Batch-invariance targets (issue 25, docs/determinism.md): greedy tokens + logprobs
and seeded samples bitwise identical alone, in mixed batches of 1..32, after a
prefix-cache hit and after preemption, per configuration (dtype x weights x mode).
Prints one JSON line per configuration with the counts per mode: requests the mode
guarantees (all in the full mode; prompt + max tokens within the reach in the
automatic default) and requests beyond it, each as [identical to alone, compared].

    PYTHONPATH=. python benchmarks/batch_invariance.py --dtypes bfloat16,float32 \\
        --weights auto,none --modes default,invariant \\
        --num-prompts 20 --min-len 16 --max-len 2000 --max-tokens 8

Exit status 1 when a guaranteed request differs.
"""

from __future__ import annotations

import argparse
import json
import time

from kvserve.bench.invariance import check_invariance, make_prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=2000)
    ap.add_argument("--shared-prefix", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--preempt-blocks", type=int, default=0, help="0: skip the preemption run")
    ap.add_argument(
        "--weights",
        default="auto",
        help="comma-separated --quantization values: auto (the default GGUF's Q4_1), none",
    )
    ap.add_argument(
        "--modes",
        default="default,invariant",
        help="comma-separated: default (automatic), invariant (--batch-invariant), off",
    )
    args = ap.parse_args()
    mode_values = {"default": None, "invariant": True, "off": False}
    prompts = make_prompts(
        args.num_prompts, args.min_len, args.max_len, shared_prefix=args.shared_prefix
    )
    failed = False
    configs = [
        (d, w, m)
        for d in args.dtypes.split(",")
        for w in args.weights.split(",")
        for m in args.modes.split(",")
    ]
    for dtype, weights, mode in configs:
        if mode not in mode_values:
            ap.error(f"--modes: {mode!r} is not one of {sorted(mode_values)}")
        t0 = time.perf_counter()
        try:
            rep = check_invariance(
                prompts,
                dtype=dtype,
                batch_invariant=mode_values[mode],
                max_tokens=args.max_tokens,
                max_num_seqs=args.max_num_seqs,
                preempt_blocks=args.preempt_blocks or None,
                quantization=weights,
            )
        except ValueError as e:  # a mode this build/CPU cannot run
            print(json.dumps({"dtype": dtype, "weights": weights, "mode": mode, "error": str(e)}))
            continue
        failed = failed or bool(rep.mismatches)
        print(
            json.dumps(
                {
                    "dtype": rep.dtype,
                    "weights": rep.weights,
                    "mode": mode,
                    "batch_invariant": rep.batch_invariant,
                    "invariant_max_context": rep.invariant_max_context,
                    "prompts": rep.num_prompts,
                    "prompt_lens": [min(rep.prompt_lens), max(rep.prompt_lens)],
                    "counts": rep.counts,
                    "mismatches": rep.mismatches,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            ),
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
