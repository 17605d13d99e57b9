"""Binding of ``csrc/linear_panels.cpp``: ``x @ W^T + b`` for a few rows over weights
packed in 32-column panels (the ``linear`` family of
:class:`~kvserve.model.kernels.backend.KernelBackend`)."""

from __future__ import annotations

import ctypes

import torch

from kvserve.model.kernels._ctypes import I32, I64, PTR, CFunction, flag, ptr

_PARAMS = [
    ("x", PTR),
    ("xs", I64),
    ("M", I64),
    ("K", I64),
    ("wp", PTR),
    ("N", I64),
    ("bias", PTR),
    ("out", PTR),
    ("os", I64),
    ("nthreads", I32),
]


class LinearPanels:
    """The panel linears; ``*_available``: the variant runs on this build and CPU."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._f32 = CFunction(lib, "kvs_linear_f32", _PARAMS)
        self._bf16 = CFunction(lib, "kvs_linear_bf16", _PARAMS)
        self._bf16_amx = CFunction(lib, "kvs_linear_bf16_amx", _PARAMS)
        self.linear_f32_available: bool = flag(lib, "kvs_linear_f32_available")
        self.linear_bf16_available: bool = flag(lib, "kvs_linear_bf16_available")
        self.linear_bf16_amx_available: bool = flag(lib, "kvs_linear_bf16_amx_available")

    @staticmethod
    def pack_linear_f32(weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] float32 -> the panel layout of :meth:`linear_f32`:
        [ceil(N / 32), K, 32], columns past N zero."""
        n, k = weight.shape
        panels = -(-n // 32)
        padded = torch.zeros(panels * 32, k, dtype=torch.float32)
        padded[:n] = weight
        return padded.view(panels, 32, k).transpose(1, 2).contiguous()

    @staticmethod
    def pack_linear_bf16(weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] bfloat16 (K even) -> the layout of :meth:`linear_bf16`:
        [ceil(N / 32), K / 2, 32, 2] (each column's k pairs adjacent), columns past N
        zero."""
        n, k = weight.shape
        if k % 2:
            raise ValueError(f"linear_bf16 needs an even input size, got {k}")
        panels = -(-n // 32)
        padded = torch.zeros(panels * 32, k, dtype=torch.bfloat16)
        padded[:n] = weight
        return padded.view(panels, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def linear_bf16(
        self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W^T + bias`` for bfloat16 x [M, K] (last dim contiguous), ``panels``
        from :meth:`pack_linear_bf16` of W [n, K], ``bias`` fp32 padded to
        ``panels.shape[0] * 32`` or None -> bfloat16 [M, n] (fp32 sums, rounded once).

        Rule: ``linear_bf16_available`` holds (else RuntimeError). Made for a few rows
        (decode at batch 1-4), where oneDNN's AMX kernels read the weights slower.
        """
        return self._run(self._bf16, x, panels, n, bias, torch.bfloat16)

    def linear_bf16_amx(
        self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`linear_bf16` on AMX tiles, the same packed panels and result.

        Rules: ``linear_bf16_amx_available`` holds and K is a multiple of 32 (else
        RuntimeError). Made for 5-32 rows (batched decode), where it streams the
        weights about 1.7x as fast as oneDNN's AMX GEMM on this kind of CPU.
        """
        return self._run(self._bf16_amx, x, panels, n, bias, torch.bfloat16)

    def linear_f32(
        self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W^T + bias`` for float32 x [M, K] (last dim contiguous), ``panels`` from
        :meth:`pack_linear_f32` of W [n, K], bias [n] contiguous or None -> [M, n].

        Rule: ``linear_f32_available`` holds (else RuntimeError). Made for M up to a
        few dozen rows, where it streams each weight panel once (see linear_panels.cpp).
        """
        return self._run(self._f32, x, panels, n, bias, torch.float32)

    @staticmethod
    def _run(
        fn: CFunction,
        x: torch.Tensor,
        panels: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Call a ``kvs_linear_*`` kernel (shared C signature) into a new [M, n] tensor."""
        rows, k = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(rows, n, dtype=dtype)
        fn.checked(
            x=x.data_ptr(),
            xs=x.stride(0),
            M=rows,
            K=k,
            wp=panels.data_ptr(),
            N=n,
            bias=ptr(bias),
            out=out.data_ptr(),
            os=n,
            nthreads=torch.get_num_threads(),
        )
        return out
