"""ctypes bindings of ``csrc/linear_quant.cpp`` (built into the same library as the
other native kernels by :mod:`kvserve.model.kernels.build`)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvserve.model.quant.formats import QuantWeight

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
PATHS = {"best": 0, "scalar": 1, "avx2": 2, "vnni": 3}


class QuantKernel:
    """``kvs_linear_quant`` / ``kvs_quant_embed``; see the C source for the arithmetic."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        self._linear = lib.kvs_linear_quant
        self._linear.argtypes = [vp, i64, i64, i64, i32, vp, i32, i64, vp, vp, i64, i32, i32, i32]
        self._linear.restype = i32
        self._embed = lib.kvs_quant_embed
        self._embed.argtypes = [vp, i32, i64, i64, vp, i64, vp, i32, i32]
        self._embed.restype = i32
        lib.kvs_linear_quant_paths.restype = i32
        bits = int(lib.kvs_linear_quant_paths())
        self.paths = {name for name, b in (("scalar", 1), ("avx2", 2), ("vnni", 4)) if bits & b}

    def linear(
        self,
        x: torch.Tensor,
        w: QuantWeight,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        path: str = "best",
    ) -> torch.Tensor:
        """``x @ W^T + bias``: x [M, k] float32/bfloat16 (last dim contiguous), bias fp32
        [n] contiguous or None; into ``out`` ([M, n] view with contiguous last dim, x's
        dtype) or a new tensor. ``path`` one of PATHS (tests pin each)."""
        rows, k = x.shape
        if k != w.k:
            raise ValueError(f"input has {k} features, weight expects {w.k}")
        if x.stride(1) != 1:
            x = x.contiguous()
        if out is None:
            out = torch.empty(rows, w.n, dtype=x.dtype)
        rc = self._linear(
            x.data_ptr(),
            x.stride(0),
            rows,
            k,
            _DTYPES[x.dtype],
            w.data.data_ptr(),
            w.fmt.code,
            w.n,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            _DTYPES[out.dtype],
            PATHS[path],
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"kvs_linear_quant returned {rc} (path {path})")
        return out

    def embed(self, w: QuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` [T] int64 (each in [0, n)) of W, dequantized -> [T, k] ``dtype``."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], w.k, dtype=dtype)
        rc = self._embed(
            w.data.data_ptr(),
            w.fmt.code,
            w.n,
            w.k,
            ids.data_ptr(),
            ids.shape[0],
            out.data_ptr(),
            _DTYPES[dtype],
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"kvs_quant_embed returned {rc}")
        return out


@functools.cache
def _load(path: str) -> QuantKernel:
    return QuantKernel(Path(path))


def load_quant_kernel(path: Path) -> QuantKernel:
    """The bindings of the library at ``path`` (loaded once per path)."""
    return _load(str(path))


def get_quant_kernel() -> QuantKernel | None:
    """The default backend's ``quant_linear`` family, or None where it is off (then
    :class:`~kvserve.model.quant.linear.QuantLinear` runs the PyTorch reference)."""
    from kvserve.model.kernels.backend import default_backend

    return default_backend().quant_linear
