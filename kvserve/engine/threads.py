"""Threads the engine starts besides the engine thread (see docs/architecture.md)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_in_scratch_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread that ends when it returns; its result or exception.

    Loading and warming the model run PyTorch's parallel kernels, and GNU OpenMP
    keeps a pool of worker threads for every thread that ever ran one. A pool left
    on the main thread plus the engine thread's own pool is more OpenMP threads than
    cores, and libgomp then stops spinning between parallel regions: every one of a
    decode step's ~400 kernels waits for its workers to wake up. A pool made by a
    thread that ended is freed, so the engine thread's is the only one."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=target, name="kvserve-build")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
