"""Give memory back after the engine has been idle (``IdleTrimmer``).

While serving, :func:`kvserve.engine.allocator.tune_allocator` keeps step-sized
buffers in glibc's heap (a 1 GiB trim threshold), and the server's GC thresholds
(``serve_cmd``) collect cycles rarely: both trade memory for step time. Once nothing
has run for ``idle_s`` seconds (default 120), :meth:`IdleTrimmer.tick` runs one full
``gc.collect()`` and glibc's ``malloc_trim(0)``, which returns free heap pages (also
inside the heap, not only at its top) to the kernel; it runs once per idle period,
again only after the engine did some work. On a system without glibc only the GC
runs. Costs a few ms to some 100 ms of the engine thread, at a time it has nothing
to do (a request arriving meanwhile waits at most that long).

Rules: one thread (the engine's) calls ``tick``; ``now`` is ``time.monotonic()``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

IDLE_TRIM_S = 120.0


def _load_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_malloc_trim = _load_malloc_trim()


def trim_memory() -> bool:
    """Collect every GC generation, then ``malloc_trim(0)``; True when glibc
    released memory (False without glibc, or nothing to release)."""
    gc.collect()
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))


class IdleTrimmer:
    """Calls ``trim`` once after each stretch of ``idle_s`` seconds without work."""

    def __init__(self, idle_s: float = IDLE_TRIM_S, trim: Callable[[], bool] = trim_memory) -> None:
        self.idle_s = idle_s
        self._trim = trim
        self._idle_since: float | None = None
        self._trimmed = False
        self.num_trims = 0

    def tick(self, now: float, *, idle: bool) -> bool:
        """Report whether the engine is idle now; returns True when it trimmed."""
        if not idle:
            self._idle_since, self._trimmed = None, False
            return False
        if self._idle_since is None:
            self._idle_since = now
        if self._trimmed or now - self._idle_since < self.idle_s:
            return False
        self._trimmed = True
        t0 = time.perf_counter()
        released = self._trim()
        self.num_trims += 1
        logger.info(
            "idle for %.0f s: gc + malloc_trim in %.0f ms (released: %s)",
            now - self._idle_since,
            (time.perf_counter() - t0) * 1000,
            released,
        )
        return True
