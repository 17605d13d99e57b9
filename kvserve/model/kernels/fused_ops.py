"""Binding of ``csrc/fused_ops.cpp``: add+RMSNorm, per-head RMSNorm, SiLU*mul, RoPE+KV write (the
``norms`` family of :class:`~kvserve.model.kernels.backend.KernelBackend`)."""

from __future__ import annotations

import ctypes

import torch

from kvserve.model.kernels._ctypes import DTYPE_CODES, F32, I32, I64, PTR, CFunction, ptr


class FusedOps:
    """The fused per-layer ops; each method states its rules."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = CFunction(
            lib,
            "kvs_add_rms_norm",
            [
                ("residual", PTR),
                ("x", PTR),
                ("x_stride", I64),
                ("w", PTR),
                ("out", PTR),
                ("rows", I64),
                ("hidden", I64),
                ("eps", F32),
                ("dtype", I32),
                ("nthreads", I32),
            ],
        )
        self._silu = CFunction(
            lib,
            "kvs_silu_mul",
            [
                ("gu", PTR),
                ("out", PTR),
                ("rows", I64),
                ("inter", I64),
                ("dtype", I32),
                ("nthreads", I32),
            ],
        )
        self._head_norm = CFunction(
            lib,
            "kvs_head_rms_norm",
            [
                ("qkv", PTR),
                ("row_stride", I64),
                ("rows", I64),
                ("heads", I32),
                ("head_dim", I32),
                ("w", PTR),
                ("eps", F32),
                ("dtype", I32),
                ("nthreads", I32),
            ],
        )
        self._rope = CFunction(
            lib,
            "kvs_rope_and_cache",
            [
                ("qkv", PTR),
                ("row_stride", I64),
                ("rows", I64),
                ("num_heads", I32),
                ("num_kv_heads", I32),
                ("head_dim", I32),
                ("positions", PTR),
                ("cos", PTR),
                ("sin", PTR),
                ("kv", PTR),
                ("num_slots", I64),
                ("slots", PTR),
                ("dtype", I32),
                ("nthreads", I32),
            ],
        )

    def add_rms_norm(
        self,
        residual: torch.Tensor,
        x: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """``residual += x`` (in place, fp32) then RMSNorm of it times ``weight``.

        residual [T, hidden] fp32 contiguous; x [T, hidden] (rows may be strided, last
        dim contiguous) and weight [hidden] in the model dtype (float32/bfloat16).
        Returns the normed rows [T, hidden] in the model dtype.
        """
        rows, hidden = residual.shape
        out = torch.empty(rows, hidden, dtype=weight.dtype)
        self._norm.checked(
            residual=residual.data_ptr(),
            x=ptr(x),
            x_stride=0 if x is None else x.stride(0),
            w=weight.data_ptr(),
            out=out.data_ptr(),
            rows=rows,
            hidden=hidden,
            eps=eps,
            dtype=DTYPE_CODES[weight.dtype],
            nthreads=torch.get_num_threads(),
        )
        return out

    def head_rms_norm(
        self, qkv: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor, eps: float
    ) -> None:
        """Per-head RMSNorm (Qwen3's q/k norms), in place on the first ``heads`` heads
        of each row: ``x = round(x * rsqrt(mean(x^2) + eps)) * weight[head]``.

        qkv [T, >= heads * head_dim] in the model dtype (float32/bfloat16), last dim
        contiguous; weight [heads, head_dim] contiguous, same dtype.
        """
        if weight.shape != (heads, head_dim) or not weight.is_contiguous():
            raise ValueError(f"head norm weight must be a contiguous [{heads}, {head_dim}]")
        if qkv.dtype != weight.dtype or qkv.stride(1) != 1:
            raise ValueError("qkv must share the weight's dtype, with contiguous rows")
        self._head_norm.checked(
            qkv=qkv.data_ptr(),
            row_stride=qkv.stride(0),
            rows=qkv.shape[0],
            heads=heads,
            head_dim=head_dim,
            w=weight.data_ptr(),
            eps=eps,
            dtype=DTYPE_CODES[weight.dtype],
            nthreads=torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] contiguous -> silu(gate) * up [T, I], same dtype."""
        rows, two_i = gate_up.shape
        out = torch.empty(rows, two_i // 2, dtype=gate_up.dtype)
        self._silu.checked(
            gu=gate_up.data_ptr(),
            out=out.data_ptr(),
            rows=rows,
            inter=two_i // 2,
            dtype=DTYPE_CODES[gate_up.dtype],
            nthreads=torch.get_num_threads(),
        )
        return out

    def rope_and_cache(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """RoPE on q and k of ``qkv`` [T, (H + 2Hk) * D] in place; K/V rows to their slots.

        Rules: ``qkv`` contiguous rows; positions [T] int64 below ``cos.shape[0]``;
        cos/sin [max_pos, D/2] fp32 contiguous; kv_cache [2, Hk, blocks, block_size, D]
        contiguous in qkv's dtype; slot_mapping [T] int64, -1 = not written.
        """
        self._rope.checked(
            qkv=qkv.data_ptr(),
            row_stride=qkv.stride(0),
            rows=qkv.shape[0],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            positions=positions.data_ptr(),
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            kv=kv_cache.data_ptr(),
            num_slots=kv_cache.shape[2] * kv_cache.shape[3],
            slots=slot_mapping.data_ptr(),
            dtype=DTYPE_CODES[qkv.dtype],
            nthreads=torch.get_num_threads(),
        )
