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
