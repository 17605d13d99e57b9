"""Idle memory give-back (kvserve/engine/memory.py)."""

from __future__ import annotations

import sys

from kvserve.engine import memory
from kvserve.engine.memory import IdleTrimmer, trim_memory


def test_trims_once_per_idle_stretch() -> None:
    calls: list[int] = []
    trimmer = IdleTrimmer(120.0, trim=lambda: calls.append(1) is None)
    assert not trimmer.tick(0.0, idle=True)
    assert not trimmer.tick(119.0, idle=True)
    assert trimmer.tick(120.5, idle=True) and len(calls) == 1
    assert not trimmer.tick(500.0, idle=True) and len(calls) == 1  # once per stretch
    assert not trimmer.tick(501.0, idle=False)  # work resets the clock
    assert not trimmer.tick(502.0, idle=True)
    assert not trimmer.tick(621.0, idle=True)
    assert trimmer.tick(622.5, idle=True) and len(calls) == 2 and trimmer.num_trims == 2


def test_trim_memory_runs_on_this_platform() -> None:
    big = [bytearray(4096) for _ in range(20_000)]  # ~80 MB of small heap blocks
    del big
    released = trim_memory()
    if not sys.platform.startswith("linux"):
        assert released is False
    else:  # glibc here: the binding loaded and the call went through
        assert memory._malloc_trim is not None and isinstance(released, bool)
