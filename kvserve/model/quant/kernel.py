"""ctypes bindings of ``csrc/linear_quant.cpp`` (built into the same library as the
other native kernels by :mod:`kvserve.model.kernels.build`)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvserve.model.quant.formats import QuantWeight

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
PATHS = {"best": 0, "scalar": 1, "avx2": 2, "vnni": 3}
K_CODES = 16  # format codes from here on run csrc/linear_kquant.cpp (quant/kquant.py)


class QuantKernel:
    """``kvs_linear_quant`` / ``kvs_quant_embed``; see the C source for the arithmetic."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        self._linear = lib.kvs_linear_quant
        self._linear.argtypes = [vp, i64, i64, i64, i32, vp, i32, i64, vp, vp, i64, i32, i32, i32]
        self._linear.restype = i32
        self._silu = lib.kvs_linear_quant_silu_mul
        self._silu.argtypes = self._linear.argtypes
        self._silu.restype = i32
        self._embed = lib.kvs_quant_embed
        self._embed.argtypes = [vp, i32, i64, i64, vp, i64, vp, i32, i32]
        self._embed.restype = i32
        # GGUF K-quant formats (codes >= 16, csrc/linear_kquant.cpp): same arguments
        self._klinear = lib.kvs_linear_kquant
        self._klinear.argtypes = self._linear.argtypes
        self._klinear.restype = i32
        self._kembed = lib.kvs_kquant_embed
        self._kembed.argtypes = self._embed.argtypes
        self._kembed.restype = i32
        self._kpack = lib.kvs_kquant_pack_gguf
        self._kpack.argtypes = [vp, i32, i64, i64, vp, i32]
        self._kpack.restype = i32
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
        fn = self._klinear if w.fmt.code >= K_CODES else self._linear
        return self._call(fn, x, w, w.n, bias, out, path)

    def linear_silu_mul(
        self,
        x: torch.Tensor,
        w: QuantWeight,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        path: str = "best",
    ) -> torch.Tensor:
        """``silu(g) * u`` where ``[g | u] = x @ W^T + bias`` (W a fused gate_up weight:
        its first n/2 rows the gate; n/2 a multiple of 16) -> [M, n/2] in x's dtype, the
        values ``kvs_silu_mul(linear(x))`` gives, in one pass over W."""
        if w.n % 32 != 0:
            raise ValueError(f"fused silu needs a multiple of 32 columns, got {w.n}")
        if w.fmt.code >= K_CODES:
            raise ValueError(f"fused silu has no {w.fmt.name} kernel: run the linear, then SiLU")
        return self._call(self._silu, x, w, w.n // 2, bias, out, path)

    def _call(
        self,
        fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
        x: torch.Tensor,
        w: QuantWeight,
        n_out: int,
        bias: torch.Tensor | None,
        out: torch.Tensor | None,
        path: str,
    ) -> torch.Tensor:
        rows, k = x.shape
        if k != w.k:
            raise ValueError(f"input has {k} features, weight expects {w.k}")
        if x.stride(1) != 1:
            x = x.contiguous()
        if out is None:
            out = torch.empty(rows, n_out, dtype=x.dtype)
        rc = fn(
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

    def bind(
        self, w: QuantWeight, bias: torch.Tensor | None = None, silu: bool = False
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A call ``f(x) -> out`` of :meth:`linear` (or :meth:`linear_silu_mul` with
        ``silu``) on the best path with the weight's arguments fixed, for the decode
        path's per-call cost. Rules: ``w.data`` and ``bias`` stay alive and unchanged
        while ``f`` is used; x float32/bfloat16 [M, k]; out a new [M, n] (n/2 with silu)
        tensor in x's dtype."""
        if silu and w.n % 32 != 0:
            raise ValueError(f"fused silu needs a multiple of 32 columns, got {w.n}")
        if silu and w.fmt.code >= K_CODES:
            raise ValueError(f"fused silu has no {w.fmt.name} kernel: run the linear, then SiLU")
        if w.fmt.code >= K_CODES:
            fn = self._klinear
        else:
            fn = self._silu if silu else self._linear
        k, n, code = w.k, w.n, w.fmt.code
        n_out = n // 2 if silu else n
        wptr = w.data.data_ptr()
        bptr = None if bias is None else bias.data_ptr()
        dtypes, empty, threads = _DTYPES, torch.empty, torch.get_num_threads

        def run(x: torch.Tensor) -> torch.Tensor:
            rows, kx = x.shape
            if kx != k:
                raise ValueError(f"input has {kx} features, weight expects {k}")
            if x.stride(1) != 1:
                x = x.contiguous()
            dt = dtypes[x.dtype]
            out = empty(rows, n_out, dtype=x.dtype)
            rc = fn(
                x.data_ptr(), x.stride(0), rows, k, dt, wptr, code, n, bptr,
                out.data_ptr(), n_out, dt, 0, threads(),
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"kvs_linear_quant returned {rc}")
            return out

        return run

    def pack_gguf_kquant(
        self, raw: np.ndarray, code: int, n: int, k: int, out_bytes: int
    ) -> torch.Tensor:
        """Raw GGUF Q4_K/Q5_K/Q6_K rows (C-contiguous uint8 array, read-only is fine:
        n * k/256 blocks) -> the K-quant tile layout (format ``code`` 16/17/18,
        ``out_bytes`` long), in C."""
        if raw.dtype != np.uint8 or not raw.flags.c_contiguous:
            raise ValueError("raw GGUF blocks must be a C-contiguous uint8 array")
        out = torch.empty(out_bytes, dtype=torch.uint8)
        ptr = raw.ctypes.data
        rc = self._kpack(ptr, code, n, k, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"kvs_kquant_pack_gguf returned {rc}")
        return out

    def embed(self, w: QuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` [T] int64 (each in [0, n)) of W, dequantized -> [T, k] ``dtype``."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], w.k, dtype=dtype)
        fn = self._kembed if w.fmt.code >= K_CODES else self._embed
        rc = fn(
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
