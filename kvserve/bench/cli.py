"""``kvserve bench {serve,compare,step-cost,forward}``.

- ``serve``: load-test any OpenAI-compatible server (kvserve, vLLM, llama.cpp)
  (``kvserve.bench.serve_bench``).
- ``compare``: run a preset against several kvserve configurations (each started as
  ``kvserve serve``) and the HF transformers baseline; print a table of ratios
  (``kvserve.bench.compare_cmd``).
- ``step-cost``: the step-time cost model's prediction error on real steps
  (``kvserve.bench.step_cost``).
- ``forward``: the model forward-pass benchmark, implemented in
  ``kvserve.bench.forward`` (imported when the parser is built, like the top-level
  subcommands; "not yet available" while that module is missing).

Heavy imports (httpx, numpy, matplotlib, transformers) happen inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvserve.bench import compare_cmd, serve_bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench sub-subcommands to ``parser`` (the ``kvserve bench`` parser)."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    p = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server",
        description="Load-test any OpenAI-compatible server (kvserve, vLLM, llama.cpp's server): "
        "stream every request, report throughput, TTFT/TPOT/ITL/E2E percentiles, goodput and "
        "the prefix-cache hit rate, and write results.json and PNG plots.",
    )
    serve_bench.add_arguments(p)
    p.set_defaults(_bench_run=serve_bench.run)
    p = sub.add_parser(
        "compare",
        help="compare kvserve configurations and the HF baseline",
        description="Run one preset workload against several kvserve configurations, each started "
        "as its own `kvserve serve`, plus the HF transformers static-batching baseline, and print "
        "each figure with its ratio to a reference configuration.",
    )
    compare_cmd.add_arguments(p)
    p.set_defaults(_bench_run=compare_cmd.run)
    from kvserve.bench import step_cost

    p = sub.add_parser(
        "step-cost",
        help="the step-time cost model's prediction error on real steps",
        description=step_cost.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    step_cost.add_arguments(p)
    p.set_defaults(_bench_run=step_cost.run)
    from kvserve.bench import invariance

    p = sub.add_parser(
        "invariance",
        help="batch invariance: alone vs batched vs cache hit vs disaggregated, bitwise",
        description=invariance.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    invariance.add_arguments(p)
    p.set_defaults(_bench_run=invariance.run)
    p = sub.add_parser("forward", help="model forward-pass benchmark")
    try:
        forward = importlib.import_module("kvserve.bench.forward")
    except ModuleNotFoundError as e:
        if e.name != "kvserve.bench.forward":
            raise
        p.set_defaults(_bench_run=_forward_unavailable)
    else:
        forward.add_arguments(p)
        p.set_defaults(_bench_run=forward.run)


def run(args: argparse.Namespace) -> int:
    """Dispatch to the chosen bench command; 2 when none was chosen."""
    if getattr(args, "_bench_run", None) is None:
        print(
            "usage: kvserve bench {serve,compare,step-cost,invariance,forward} ... "
            "(see kvserve bench -h)",
            file=sys.stderr,
        )
        return 2
    return int(args._bench_run(args) or 0)


def _forward_unavailable(args: argparse.Namespace) -> int:
    print("kvserve bench forward: not yet available in this version", file=sys.stderr)
    return 2
