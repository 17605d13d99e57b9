"""Batch-invariance targets (issue 25, docs/determinism.md): greedy tokens + logprobs
and seeded samples bitwise identical alone, in mixed batches of 1..32, after a
prefix-cache hit, after preemption and (``--disagg``) through a prefill worker +
decode worker, per configuration (dtype x weights x mode). The same as ``kvserve bench
invariance`` (:mod:`kvserve.bench.invariance`); one JSON line per configuration.

    PYTHONPATH=. python benchmarks/batch_invariance.py --dtypes bfloat16,float32 \\
        --weights auto --modes default,invariant --disagg \\
        --num-prompts 20 --min-len 16 --max-len 2000 --max-tokens 8

Exit status 1 when a guaranteed request differs.
"""

from __future__ import annotations

import argparse

from kvserve.bench import invariance


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    invariance.add_arguments(ap)
    return invariance.run(ap.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
