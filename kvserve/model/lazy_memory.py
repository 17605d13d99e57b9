"""CPU tensors whose memory is committed as it is touched (the lazily sized KV pool).

On CPU ``--gpu-memory-utilization`` is a *ceiling* for the KV pool: :func:`lazy_zeros` maps anonymous memory
(``mmap``), which reads as zeros and takes a physical page only when a KV block is
first written there, so the process holds what its requests have used, not what it
may use. No huge-page advice on such a pool: one touched 2 MB page per layer, K/V
and head would commit far more than the blocks in use (and ``khugepaged`` would fill
the rest in over time).

:func:`resident_bytes` says how much of a tensor's memory is resident now
(``mincore``; None where that is not available), for the startup log and
``/metrics``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import sys

import torch

_PAGE = mmap.PAGESIZE


def lazy_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous CPU tensor of ``shape`` whose pages are committed on first
    touch. The tensor keeps its mapping alive; it is freed with the tensor."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    return raw.view(dtype).view(*shape)


@functools.cache
def _mincore() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def resident_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t``'s storage resident in RAM now (page granularity); None where
    ``mincore`` is not available. Costs one byte per page of ``t`` while it runs."""
    fn = _mincore()
    if fn is None or t.device.type != "cpu" or os.environ.get("KVSERVE_NO_MINCORE"):
        return None
    start = t.data_ptr() // _PAGE * _PAGE
    end = t.data_ptr() + t.numel() * t.element_size()
    pages = -(-(end - start) // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if fn(start, end - start, vec) != 0:
        return None
    return sum(b & 1 for b in bytes(vec)) * _PAGE
