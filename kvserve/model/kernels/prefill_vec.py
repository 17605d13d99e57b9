"""Binding of ``csrc/prefill_vec.cpp``: prefill attention on AVX-512/AVX2 (no AMX)."""

from __future__ import annotations

import ctypes
import os

import torch

from kvserve.model.kernels._ctypes import (
    DTYPE_CODES,
    F32,
    I32,
    PAGED_PARAMS,
    TAIL_PARAMS,
    CFunction,
    paged_args,
    tail_args,
)

# the variants of the kernel, by name -> the ``isa`` argument (0: the best usable)
PREFILL_VEC_ISAS = {"avx2": 1, "avx512": 2, "avx512bf16": 3}
# read at each use (as a per-step switch): "0" keeps prefill chunks off this kernel;
# "avx2", "avx512", "avx512bf16" force that variant (where usable); "1"/unset: the best
VEC_ENV_VAR = "KVSERVE_PREFILL_VEC"

_PARAMS = [
    *PAGED_PARAMS,
    ("scale", F32),
    ("dtype", I32),
    ("isa", I32),
    *TAIL_PARAMS,
]

# kvs_prefill_attention_inv: no isa, plus seg (kv_segment_size) before scale
_INV_PARAMS = [
    *PAGED_PARAMS,
    ("seg", I32),
    *(p for p in _PARAMS[len(PAGED_PARAMS) :] if p[0] != "isa"),
]


class PrefillVec:
    """``kvs_prefill_attention_vec``; ``isas``: the variants usable on this CPU, by name."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = CFunction(lib, "kvs_prefill_attention_vec", _PARAMS)
        self._inv = CFunction(lib, "kvs_prefill_attention_inv", _INV_PARAMS)
        probe = lib.kvs_prefill_vec_isas
        probe.argtypes = []
        probe.restype = I32
        bits = int(probe())
        self.isas: frozenset[str] = frozenset(
            name for name, bit in PREFILL_VEC_ISAS.items() if bits & (1 << bit)
        )

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether :meth:`__call__` runs here for this dtype and head_dim (32, 64 or 128;
        float32 or bfloat16; an AVX2 or AVX-512 CPU) with ``KVSERVE_PREFILL_VEC`` not
        ``0`` (a forced variant must be usable)."""
        env = os.environ.get(VEC_ENV_VAR, "1")
        if env == "0" or dtype not in DTYPE_CODES or head_dim not in (32, 64, 128):
            return False
        if env in PREFILL_VEC_ISAS:
            return env in self.isas and (env != "avx512bf16" or dtype == torch.bfloat16)
        return bool(self.isas)

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        seqs: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        row_map: torch.Tensor | None = None,
        merge: bool = False,
        isa: str | None = None,
    ) -> None:
        """:class:`~kvserve.model.kernels.prefill_amx.PrefillAmx`'s contract on
        AVX-512/AVX2, for float32 or bfloat16 (q, out and kv_cache share the dtype).

        Rules: :meth:`supports` holds for q's dtype and head_dim; any block_size.
        ``isa``: None = ``KVSERVE_PREFILL_VEC`` if it names a variant, else the best usable one
        (vdpbf16ps for bfloat16 on AMD CPUs that have it, where it was measured at the
        fp32 FMA rate; fp32 FMAs otherwise); or one of :data:`PREFILL_VEC_ISAS`
        (RuntimeError where unusable). A row's result does not depend on the other
        rows of the call (see the source).
        """
        name = isa if isa is not None else os.environ.get(VEC_ENV_VAR, "1")
        rc = self._fn(
            **paged_args(q, out, kv_cache, seqs, block_tables),
            scale=scale,
            dtype=DTYPE_CODES[q.dtype],
            isa=PREFILL_VEC_ISAS.get(name, 0),
            **tail_args(lse, row_map, merge),
        )
        if rc != 0:
            raise RuntimeError(f"kvs_prefill_attention_vec returned {rc} (isa {name!r})")

    # ------------------------------------------------------------ invariant variant
    def supports_invariant(
        self, dtype: torch.dtype, head_dim: int, block_size: int, kv_segment_size: int
    ) -> bool:
        """Whether :meth:`invariant` runs here: AVX-512 (F + BW), float32 or bfloat16,
        head_dim 32, 64 or 128, an even ``block_size`` and ``kv_segment_size``, and
        ``KVSERVE_PREFILL_VEC`` not ``0``."""
        return (
            os.environ.get(VEC_ENV_VAR, "1") != "0"
            and "avx512" in self.isas
            and dtype in DTYPE_CODES
            and head_dim in (32, 64, 128)
            and block_size % 2 == 0
            and kv_segment_size % 2 == 0
        )

    def invariant(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        seqs: torch.Tensor,
        block_tables: torch.Tensor,
        kv_segment_size: int,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        row_map: torch.Tensor | None = None,
        merge: bool = False,
    ) -> None:
        """:meth:`__call__`'s contract, but every row computed with exactly the per-row
        arithmetic of the paged kernel (``kvs_paged_attention`` with the same
        ``kv_segment_size``): a position's output and lse are bitwise those of the same
        position as a decode row there (batch invariance, docs/determinism.md), at the
        prefill kernel's row-in-lanes speed. Rules: :meth:`supports_invariant` holds."""
        rc = self._inv(
            **paged_args(q, out, kv_cache, seqs, block_tables),
            seg=kv_segment_size,
            scale=scale,
            dtype=DTYPE_CODES[q.dtype],
            **tail_args(lse, row_map, merge),
        )
        if rc != 0:
            raise RuntimeError(f"kvs_prefill_attention_inv returned {rc}")
