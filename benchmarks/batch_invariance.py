"""Batch-invariance targets (issue 25, docs/determinism.md): greedy tokens + logprobs
and seeded samples bitwise identical alone, in mixed batches of 1..32, after a
prefix-cache hit and after preemption, per dtype.

    PYTHONPATH=. python benchmarks/batch_invariance.py --dtypes bfloat16,float32 \\
        --num-prompts 20 --min-len 16 --max-len 2000 --max-tokens 8
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
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None)
    args = ap.parse_args()
    prompts = make_prompts(
        args.num_prompts, args.min_len, args.max_len, shared_prefix=args.shared_prefix
    )
    failed = False
    for dtype in args.dtypes.split(","):
        t0 = time.perf_counter()
        rep = check_invariance(
            prompts,
            dtype=dtype,
            batch_invariant=args.batch_invariant,
            max_tokens=args.max_tokens,
            max_num_seqs=args.max_num_seqs,
            preempt_blocks=args.preempt_blocks or None,
        )
        failed = failed or bool(rep.mismatches)
        print(
            json.dumps(
                {
                    "dtype": rep.dtype,
                    "batch_invariant": rep.batch_invariant,
                    "prompts": rep.num_prompts,
                    "prompt_lens": [min(rep.prompt_lens), max(rep.prompt_lens)],
                    "modes": rep.modes,
                    "mismatches": rep.mismatches,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            ),
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
