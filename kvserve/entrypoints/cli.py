"""The ``kvserve`` command. Each subcommand lives in its own module that exposes
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported lazily so
``kvserve simulate`` never imports torch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from typing import NoReturn

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


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an unknown flag prints *this* subcommand's usage and
    the closest known flag (argparse would print the top-level usage)."""

    def error(self, message: str) -> NoReturn:
        unknown = re.findall(r"(--?[\w-]+)", message.split(":", 1)[-1])
        hint = ""
        if message.startswith("unrecognized arguments") and unknown:
            known = [s for a in self._actions for s in a.option_strings]
            close = difflib.get_close_matches(unknown[0].split("=")[0], known, n=1, cutoff=0.5)
            if close:
                hint = f"; did you mean {close[0]}?"
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve LLM serving engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_SubcommandParser)
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
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = _subparser(parser, getattr(args, "command", None))
        (sub or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(f"kvserve {args.command}: not yet available in this version", file=sys.stderr)
        return 2
    return int(args._run(args) or 0)


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]  # type: ignore[no-any-return]
    return None


if __name__ == "__main__":
    sys.exit(main())
