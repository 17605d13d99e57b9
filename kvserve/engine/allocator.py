"""Keep glibc's malloc from handing step-sized buffers back to the kernel.

A prefill step allocates and frees tensors of several MB per layer (a 2,048-token
chunk's gate/up output is 12 MB in bf16). With glibc's defaults those go back to the
kernel when freed (``munmap`` or a heap trim) and the next layer faults them in
again, zero-filled: about 30,000 page faults and 60-90 ms of system time per
2,048-token step here. :func:`tune_allocator` serves them from the heap instead
(``M_MMAP_THRESHOLD`` 32 MiB, glibc's largest; ``M_TRIM_THRESHOLD`` 1 GiB; one
arena), the way a server preloads tcmalloc or jemalloc (figures: docs/performance.md,
"glibc keeps step buffers"). Call it before the process starts threads (``kvserve``'s
CLI does, first thing; engines call it again, which is then a no-op).

The cost: the process keeps its peak heap instead of returning it. Set
``KVSERVE_MALLOPT=0`` to leave the allocator alone (also for non-glibc systems,
where this is a no-op)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc ignores anything above HEAP_MAX / 2 = 32 MiB
TRIM_THRESHOLD = 1 << 30

_done: bool | None = None


def tune_allocator() -> bool:
    """Apply the thresholds once per process; True when they are in effect.

    Idempotent and thread-safe enough to call from every engine constructor (a
    second call returns the first call's answer)."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("KVSERVE_MALLOPT", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # One arena: a thread's own arena grows in heaps of at most 64 MiB, which glibc
    # unmaps and maps again as step buffers come and go (measured: 12k-21k page
    # faults for a loop that took 15k-95k in a thread arena). Set both thresholds,
    # never the trim threshold alone: that turns off glibc's adaptive mmap threshold
    # and every buffer above 128 KiB would be mmapped (190k faults in that loop).
    ok = mallopt(_M_ARENA_MAX, 1) == 1
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and ok
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.info("glibc mallopt refused the thresholds; allocator left as it is")
    _done = ok
    return ok
