"""Binding of ``csrc/sampling.cpp``: per-row argmax, softmax, top-p threshold and
inverse-CDF draw over fp32 logits (the ``sampling`` family of
:class:`~kvserve.model.kernels.backend.KernelBackend`)."""

from __future__ import annotations

import ctypes

import torch

from kvserve.model.kernels._ctypes import I32, I64, PTR, CFunction


class Sampling:
    """The sampling helpers; every tensor is a contiguous fp32 CPU tensor unless said."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        rows = [("rows", I64), ("cols", I64)]
        self._argmax = CFunction(
            lib,
            "kvs_argmax_rows",
            [("x", PTR), *rows, ("out", PTR), ("nthreads", I32)],
            restype=None,
        )
        self._top_p = CFunction(
            lib,
            "kvs_top_p_threshold",
            [("probs", PTR), *rows, ("top_p", PTR), ("out", PTR), ("nthreads", I32)],
            restype=None,
        )
        self._sample = CFunction(
            lib,
            "kvs_sample_rows",
            [("probs", PTR), *rows, ("threshold", PTR), ("u", PTR), ("out", PTR)]
            + [("nthreads", I32)],
            restype=None,
        )
        self._softmax = CFunction(
            lib,
            "kvs_softmax_rows",
            [("x", PTR), *rows, ("inv_temp", PTR), ("out", PTR), ("nthreads", I32)],
            restype=None,
        )

    def softmax_rows(self, logits: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
        """``softmax(logits * inv_temperature[:, None], -1)``; contiguous fp32 [B, V] CPU.

        ``inv_temperature`` fp32 [B], every entry > 0.
        """
        rows, cols = logits.shape
        inv_temperature = inv_temperature.to(torch.float32).contiguous()
        out = torch.empty(rows, cols, dtype=torch.float32)
        self._softmax(
            x=logits.data_ptr(),
            rows=rows,
            cols=cols,
            inv_temp=inv_temperature.data_ptr(),
            out=out.data_ptr(),
            nthreads=torch.get_num_threads(),
        )
        return out

    def sample_rows(
        self, probs: torch.Tensor, threshold: torch.Tensor, uniforms: torch.Tensor
    ) -> torch.Tensor:
        """Inverse-CDF token per row over the tokens with ``probs >= threshold`` ([B]).

        probs: contiguous fp32 [B, V] CPU (unnormalized, >= 0); threshold fp32 [B];
        uniforms float64 [B] in [0, 1). Same rule as ``_inverse_cdf_sample`` on probs
        with the tail below the threshold zeroed.
        """
        rows, cols = probs.shape
        threshold = threshold.to(torch.float32).contiguous()
        uniforms = uniforms.to(torch.float64).contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        self._sample(
            probs=probs.data_ptr(),
            rows=rows,
            cols=cols,
            threshold=threshold.data_ptr(),
            u=uniforms.data_ptr(),
            out=out.data_ptr(),
            nthreads=torch.get_num_threads(),
        )
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(-1)`` for a contiguous fp32 [rows, cols] CPU tensor (rows >= 1)."""
        rows, cols = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax(
            x=x.data_ptr(),
            rows=rows,
            cols=cols,
            out=out.data_ptr(),
            nthreads=torch.get_num_threads(),
        )
        return out

    def top_p_threshold(self, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Smallest kept probability per row of the nucleus (0 where ``top_p >= 1``).

        probs: contiguous fp32 [rows, cols] CPU tensor; top_p: fp32 [rows]. Same rule
        as :func:`kvserve.sampling.sampler._apply_top_p` (sums in double, so a token
        within float rounding of the boundary may fall on the other side).
        """
        rows, cols = probs.shape
        top_p = top_p.to(torch.float32).contiguous()
        out = torch.empty(rows, dtype=torch.float32)
        self._top_p(
            probs=probs.data_ptr(),
            rows=rows,
            cols=cols,
            top_p=top_p.data_ptr(),
            out=out.data_ptr(),
            nthreads=torch.get_num_threads(),
        )
        return out
