"""The ``kvserve`` command. Each subcommand lives in its own module that exposes
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported lazily so
``kvserve simulate`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvserve.entrypoints.serve_cmd", "serve a model over an OpenAI-compatible HTTP API"),
    "generate": (
        "kvserve.entrypoints.generate_cmd",
        "generate a completion and stream it to stdout",
    ),
    "simulate": ("kvserve.sim.cli", "run the real schedulers on a workload file without a model"),
    "bench": ("kvserve.bench.cli", "benchmarks: forward, serve, compare"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve LLM serving engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            p.set_defaults(_unavailable=name)
            continue
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvserve.engine.allocator import tune_allocator

    tune_allocator()  # before any thread starts (see kvserve/engine/allocator.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(f"kvserve {args.command}: not yet available in this version", file=sys.stderr)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
