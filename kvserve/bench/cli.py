"""``kvserve bench {serve,compare,step-cost,invariance,forward}``.

- ``serve``: load-test any OpenAI-compatible server (kvserve, vLLM, llama.cpp)
  (``kvserve.bench.serve_bench``).
- ``compare``: run a preset against several kvserve configurations (each started as
  ``kvserve serve``) and the HF transformers baseline; print a table of ratios
  (``kvserve.bench.compare_cmd``).
- ``step-cost``: the step-time cost model's prediction error on real steps
  (``kvserve.bench.step_cost``).
- ``invariance``: batch invariance, bitwise (``kvserve.bench.invariance``).
- ``forward``: the model forward-pass benchmark (``kvserve.bench.forward``).

Each subcommand's module has ``add_arguments`` and ``run``; the modules load when the
parser is built, torch-backed ones only inside ``run``.

Heavy imports (httpx, numpy, matplotlib, transformers) happen inside ``run``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvserve.bench import compare_cmd, serve_bench


def _add(sub: Any, name: str, module: Any, help: str, description: str | None = None) -> None:
    """One subcommand: ``module.add_arguments`` builds its parser and ``module.run`` runs
    it; without ``description`` its help text is the module's docstring."""
    if description is None:
        p = sub.add_parser(
            name,
            help=help,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    else:
        p = sub.add_parser(name, help=help, description=description)
    module.add_arguments(p)
    p.set_defaults(_bench_run=module.run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench sub-subcommands to ``parser`` (the ``kvserve bench`` parser)."""
    from kvserve.bench import forward, invariance, step_cost

    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    _add(
        sub,
        "serve",
        serve_bench,
        "load-test an OpenAI-compatible server",
        "Load-test any OpenAI-compatible server (kvserve, vLLM, llama.cpp's server): stream "
        "every request, report throughput, TTFT/TPOT/ITL/E2E percentiles, goodput and the "
        "prefix-cache hit rate, and write results.json and PNG plots.",
    )
    _add(
        sub,
        "compare",
        compare_cmd,
        "compare kvserve configurations and the HF baseline",
        "Run one preset workload against several kvserve configurations, each started as its "
        "own `kvserve serve`, plus the HF transformers static-batching baseline, and print each "
        "figure with its ratio to a reference configuration.",
    )
    _add(sub, "step-cost", step_cost, "the step-time cost model's prediction error on real steps")
    _add(
        sub,
        "invariance",
        invariance,
        "batch invariance: alone vs batched vs cache hit vs disaggregated, bitwise",
    )
    _add(sub, "forward", forward, "model forward-pass benchmark")


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
