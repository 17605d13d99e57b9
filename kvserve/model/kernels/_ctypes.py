"""Shared helpers of the binding modules: C types, dtype codes, named-argument calls.

Every binding module declares each C function's parameters as ``(name, ctype)``
pairs in the order of the C prototype and calls it with keyword arguments through
:class:`CFunction`, which refuses a missing or unknown name (a TypeError) instead of
passing a shifted positional list.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

I64, I32, PTR, F32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' ``dtype`` argument


# The leading parameters of every paged attention kernel (the queries, the output, the
# layer's cache and the requests' block tables; ``Args`` in csrc/paged_walk.h).
PAGED_PARAMS: list[tuple[str, Any]] = [
    ("q", PTR),
    ("q_row_stride", I64),
    ("q_head_stride", I64),
    ("out", PTR),
    ("kv", PTR),
    ("num_blocks", I64),
    ("block_size", I32),
    ("num_heads", I32),
    ("num_kv_heads", I32),
    ("head_dim", I32),
    ("seqs", PTR),
    ("num_seqs", I64),
    ("block_tables", PTR),
    ("max_blocks", I64),
]


def paged_args(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    seqs: torch.Tensor,
    block_tables: torch.Tensor,
) -> dict[str, Any]:
    """The :data:`PAGED_PARAMS` arguments of a call: q [T, H, D] (last dim
    contiguous), ``out`` [T, H, D], ``kv_cache`` [2, Hk, blocks, block_size, row],
    ``seqs`` [S, 5] and ``block_tables`` [S, max_blocks] int64 contiguous. head_dim is
    q's D (a cache row may hold more: the 8-bit formats' scale)."""
    _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
    return {
        "q": q.data_ptr(),
        "q_row_stride": q.stride(0),
        "q_head_stride": q.stride(1),
        "out": out.data_ptr(),
        "kv": kv_cache.data_ptr(),
        "num_blocks": num_blocks,
        "block_size": block_size,
        "num_heads": q.shape[1],
        "num_kv_heads": num_kv_heads,
        "head_dim": q.shape[2],
        "seqs": seqs.data_ptr(),
        "num_seqs": seqs.shape[0],
        "block_tables": block_tables.data_ptr(),
        "max_blocks": block_tables.shape[1],
    }


# The trailing parameters of every paged attention kernel: the threads, then the
# optional lse [T, H] fp32, row map and merge flag (the end of ``Args`` in the csrc).
TAIL_PARAMS: list[tuple[str, Any]] = [
    ("num_threads", I32),
    ("lse", PTR),
    ("row_map", PTR),
    ("merge", I32),
]


def tail_args(
    lse: torch.Tensor | None, row_map: torch.Tensor | None, merge: bool
) -> dict[str, Any]:
    """The :data:`TAIL_PARAMS` arguments of a call, on torch's thread count."""
    return {
        "num_threads": torch.get_num_threads(),
        "lse": ptr(lse),
        "row_map": ptr(row_map),
        "merge": int(merge),
    }


def attention_out(
    q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None
) -> tuple[torch.Tensor, bool]:
    """(the output a paged attention call writes, whether it merges): ``out`` itself
    when given (merging into it: ValueError without the ``lse`` of what it holds),
    else a new [T, H, D] tensor in q's dtype."""
    if out is not None:
        if lse is None:
            raise ValueError("merging into out needs the lse of what it holds")
        return out, True
    return torch.empty(q.shape, dtype=q.dtype), False


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer, or None (a C null pointer) for None."""
    return None if t is None else t.data_ptr()


class CFunction:
    """One C function of the library, called with named arguments.

    ``params``: the prototype's ``(name, ctype)`` pairs in order; ``restype`` its
    return type (None for void).
    """

    def __init__(
        self,
        lib: ctypes.CDLL,
        symbol: str,
        params: Sequence[tuple[str, Any]],
        restype: Any = I32,
    ) -> None:
        self.symbol = symbol
        self._names = tuple(n for n, _ in params)
        self._name_set = frozenset(self._names)  # built once: calls run per layer
        self._fn = lib[symbol]  # a private function object: its argtypes are ours alone
        self._fn.argtypes = [t for _, t in params]
        self._fn.restype = restype

    def __call__(self, **kwargs: Any) -> Any:
        if kwargs.keys() != self._name_set:
            missing = sorted(self._name_set - kwargs.keys())
            unknown = sorted(kwargs.keys() - self._name_set)
            raise TypeError(f"{self.symbol}: missing {missing}, unknown {unknown}")
        return self._fn(*[kwargs[n] for n in self._names])

    def checked(self, **kwargs: Any) -> None:
        """Call and raise RuntimeError on a non-zero return code."""
        rc = self(**kwargs)
        if rc != 0:
            raise RuntimeError(f"{self.symbol} returned {rc}")


def flag(lib: ctypes.CDLL, symbol: str) -> bool:
    """The value of a ``int symbol(void)`` availability probe, as a bool."""
    fn = lib[symbol]
    fn.argtypes = []
    fn.restype = I32
    return bool(fn())
