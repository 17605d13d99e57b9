"""Choose the step-time budget's defaults: run the ``interference``, ``multiturn`` and
``random-c16`` compare presets (short versions) against the old default, the old
README flags and several ``--max-step-ms`` values, interleaved round by round, and
print the median table of each.

    python benchmarks/step_budget_sweep.py --presets interference,random-c16 \\
        --num-requests 14 --rounds 2 --targets 150,250,400 [--engine-args "--dtype float32"]

Each configuration is its own ``kvserve serve`` (see ``kvserve bench compare``).
A benchmark, not a test: timings on a shared machine are noisy; compare ratios
within one run.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from kvserve.bench.compare import CompareOptions, format_result, run_compare
from kvserve.bench.hf_baseline import DEFAULT_MODEL, load_tokenizer
from kvserve.bench.presets import PRESETS, Variant
from kvserve.bench.workloads import WordVocabulary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="interference,random-c16")
    p.add_argument("--num-requests", type=int, default=None, help="override every preset's")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--targets", default="150,250,400", help="--max-step-ms values to try")
    p.add_argument("--engine-args", default="", help="extra serve args for every configuration")
    p.add_argument("--output", type=Path, default=Path("bench_results/step_budget_sweep"))
    args = p.parse_args(argv)
    vocab = WordVocabulary.from_tokenizer(load_tokenizer(DEFAULT_MODEL))
    for name in args.presets.split(","):
        preset = PRESETS[name]
        base = [v for v in preset.variants if v.name != "new-default"]
        tried = [Variant(f"step-{t}ms", ("--max-step-ms", t)) for t in args.targets.split(",") if t]
        preset = replace(preset, variants=(*base, *tried), target=None)
        if args.num_requests is not None:
            preset = replace(
                preset, workload=replace(preset.workload, num_requests=args.num_requests)
            )
        opts = CompareOptions(
            output_dir=args.output / name,
            extra_engine_args=tuple(shlex.split(args.engine_args)),
            skip_hf=True,
            progress=False,
            plots=False,
            rounds=args.rounds,
        )
        result = run_compare(preset, opts, vocab)
        print(format_result(result), flush=True)
        if result["errors"]:
            print(result["errors"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
