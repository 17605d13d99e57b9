"""Large CPU tensors backed by transparent huge pages (the paged KV pool).

Decode attention reads a request's KV blocks where they lie: 2 KB pages (16 tokens ×
64 dims × bf16) scattered over a pool of hundreds of MB. With 4 KB pages nearly every
block read is a TLB miss and a page walk; with 2 MB pages the pool's translations fit
the TLB. Where the kernel's transparent huge pages are ``madvise``-only (the common
default), memory must ask for them before it is first touched:
:func:`zeros_hugepages` allocates untouched memory, advises ``MADV_HUGEPAGE`` on its
2 MB-aligned interior, then zeroes it (the first touch). Anywhere the advice is not
available (not Linux, no libc, THP off) it is a plain ``torch.zeros``; the result is
the same zeroed tensor either way, so callers need no fallback of their own.
``KVSERVE_HUGEPAGES=0`` turns the advice off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux
ENV_VAR = "KVSERVE_HUGEPAGES"


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_hugepages(t: torch.Tensor) -> bool:
    """Ask for huge pages over the 2 MB-aligned interior of ``t``'s storage (CPU, not
    yet touched for the advice to matter). True where the kernel accepted it."""
    fn = _madvise()
    if fn is None or t.device.type != "cpu" or os.environ.get(ENV_VAR, "1") == "0":
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    return fn(lo, hi - lo, MADV_HUGEPAGE) == 0


def zeros_hugepages(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous CPU tensor of ``shape``, on huge pages where the kernel
    grants them (see the module docstring); otherwise exactly ``torch.zeros``."""
    t = torch.empty(*shape, dtype=dtype)
    advise_hugepages(t)
    return t.zero_()
