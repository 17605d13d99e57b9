"""docs/configuration.md is the one table of configuration: every ``kvserve serve`` and
``kvserve generate`` flag and every ``KVSERVE_*`` switch (kvserve/switches.py), and the
code reads no switch missing there."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kvserve.entrypoints import generate_cmd, serve_args
from kvserve.switches import BY_NAME, SWITCHES

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
NAME = re.compile(r"\bKVSERVE_[A-Z0-9_]*[A-Z0-9]")


def _flags(add: object) -> set[str]:
    parser = argparse.ArgumentParser()
    add(parser)  # type: ignore[operator]
    return {
        o
        for a in parser._actions
        for o in a.option_strings
        if o.startswith("--") and not o.startswith("--no-") and o != "--help"
    }


def _names_in_code() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "kvserve").rglob("*")):
        if path.suffix not in (".py", ".cpp", ".h") or path.name == "switches.py":
            continue
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_flag_is_in_the_table() -> None:
    flags = _flags(serve_args.add_arguments) | _flags(generate_cmd.add_arguments)
    missing = sorted(f for f in flags if f"`{f}`" not in DOC and f"`{f} /" not in DOC)
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_every_switch_read_is_registered_and_documented() -> None:
    code = _names_in_code()
    unregistered = {n: p for n, p in code.items() if n not in BY_NAME}
    assert not unregistered, f"add these to kvserve/switches.py: {unregistered}"
    unread = [s.name for s in SWITCHES if s.name not in code]
    assert not unread, f"no code reads {unread}: drop them from kvserve/switches.py"
    undocumented = [s.name for s in SWITCHES if f"`{s.name}`" not in DOC]
    assert not undocumented, f"docs/configuration.md lacks {undocumented}"
