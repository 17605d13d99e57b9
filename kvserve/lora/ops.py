"""The native batched LoRA delta (``kvs_lora_delta``, kvserve/model/csrc/lora.cpp).

:func:`native_lora_kernel` returns the kernel, or None where the native library
cannot be built or loaded, or where ``KVSERVE_LORA=portable`` (or
``KVSERVE_KERNELS=portable``) asks for the torch reference
(:func:`kvserve.lora.weights.lora_delta_torch`). The kernel handles float32 and
bfloat16 rows and float32 or bfloat16 slot tensors on the CPU (AVX-512, with
AVX512_BF16 dot products for bfloat16 rows and weights, where compiled for it;
portable C++ otherwise), and picks its thread count from the work (at most torch's).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from kvserve.model.kernels._ctypes import DTYPE_CODES, I32, I64, PTR, CFunction

logger = logging.getLogger(__name__)
ENV_VAR = "KVSERVE_LORA"


class NativeLoRA:
    """The bound kernel; see the module docstring."""

    def __init__(self, fn: CFunction) -> None:
        self._fn = fn

    @staticmethod
    def supports(x: torch.Tensor, y: torch.Tensor) -> bool:
        """CPU rows of one dtype (float32 or bfloat16), unit stride along features."""
        return (
            x.device.type == "cpu"
            and y.device.type == "cpu"
            and x.dtype == y.dtype
            and x.dtype in DTYPE_CODES
            and x.dim() == 2
            and y.dim() == 2
            and (x.stride(1) == 1 or x.shape[1] == 1)
            and (y.stride(1) == 1 or y.shape[1] == 1)
        )

    def delta(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        row_slots: torch.Tensor,
        offsets: torch.Tensor,
        rank: int,
    ) -> None:
        """``y`` [T, out] += each row's delta; ``x`` [T, in]; ``a`` [S, P*R, in] and
        ``bt`` [S, R, out] contiguous, float32 or bfloat16 (one dtype); ``row_slots``
        [T] int32; ``offsets`` [P+1] int64 (see kvserve.lora.weights)."""
        self._fn.checked(
            x=x.data_ptr(),
            x_stride=x.stride(0),
            y=y.data_ptr(),
            y_stride=y.stride(0),
            rows=x.shape[0],
            in_f=x.shape[1],
            out_f=y.shape[1],
            A=a.data_ptr(),
            Bt=bt.data_ptr(),
            row_slot=row_slots.data_ptr(),
            offsets=offsets.data_ptr(),
            parts=offsets.numel() - 1,
            rank=rank,
            dtype=DTYPE_CODES[x.dtype],
            w_dtype=DTYPE_CODES[a.dtype],
            nthreads=torch.get_num_threads(),
        )


@functools.cache
def _load() -> NativeLoRA | None:
    try:
        from kvserve.model.kernels.build import load_library

        _, lib = load_library()
        fn = CFunction(
            lib,
            "kvs_lora_delta",
            [
                ("x", PTR),
                ("x_stride", I64),
                ("y", PTR),
                ("y_stride", I64),
                ("rows", I64),
                ("in_f", I64),
                ("out_f", I64),
                ("A", PTR),
                ("Bt", PTR),
                ("row_slot", PTR),
                ("offsets", PTR),
                ("parts", I32),
                ("rank", I32),
                ("dtype", I32),
                ("w_dtype", I32),
                ("nthreads", I32),
            ],
        )
    except (RuntimeError, OSError, AttributeError) as e:
        logger.warning("native LoRA kernel unavailable, using the torch path: %s", e)
        return None
    return NativeLoRA(fn)


def native_lora_kernel() -> NativeLoRA | None:
    """The native kernel, or None (use the torch path); see the module docstring."""
    for var in (ENV_VAR, "KVSERVE_KERNELS"):
        if os.environ.get(var, "").lower() == "portable":
            return None
    return _load()
