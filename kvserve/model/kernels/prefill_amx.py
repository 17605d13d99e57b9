"""Binding of ``csrc/prefill_amx.cpp``: prefill attention on AMX tiles (Intel CPUs)."""

from __future__ import annotations

import ctypes
import os

import torch

from kvserve.model.kernels._ctypes import (
    F32,
    PAGED_PARAMS,
    TAIL_PARAMS,
    CFunction,
    flag,
    paged_args,
    tail_args,
)

# read at each use (a per-step switch): "0" keeps prefill chunks off the AMX kernel
AMX_ENV_VAR = "KVSERVE_PREFILL_AMX"

_PARAMS = [
    *PAGED_PARAMS,
    ("scale", F32),
    *TAIL_PARAMS,
]


class PrefillAmx:
    """``kvs_prefill_attention_amx``; ``available``: this build and CPU have AMX-BF16."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = CFunction(lib, "kvs_prefill_attention_amx", _PARAMS)
        self.available: bool = flag(lib, "kvs_prefill_amx_available")

    def supports(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """Whether :meth:`__call__` runs for this dtype and shape here: AMX-BF16,
        bfloat16, head_dim 64, block_size a multiple of 16, and ``KVSERVE_PREFILL_AMX``
        not set to ``0``."""
        return (
            self.available
            and dtype == torch.bfloat16
            and head_dim == 64
            and block_size % 16 == 0
            and os.environ.get(AMX_ENV_VAR, "1") != "0"
        )

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
    ) -> None:
        """Rows attend to their keys in the pages on AMX tiles (see ``prefill_amx.cpp``).

        Writes the rows of ``seqs`` into ``out`` [T, H, D] (contiguous bfloat16), padding
        rows zero. Rules: :meth:`supports` holds; q [T, H, D] bfloat16 (last dim
        contiguous); the chunk's K/V are already in ``kv_cache``; ``seqs`` [S, 5] int64
        rows (row_start, num_rows, num_tokens, cached_seq_len, prior_only): row j
        attends to ``[0, cached_seq_len + j]``, or to ``[0, cached_seq_len)`` with
        prior_only 1; ``block_tables`` [S, max_blocks] int64 covering those keys;
        ``lse`` optional fp32 [T, H]; ``row_map`` optional int64: token j of a seq is
        batch row ``row_map[row_start + j]``; ``merge``: ``out``/``lse`` (required)
        already hold another part of those rows' attention, merged exactly. The kernel
        does not check bounds.
        """
        self._fn.checked(
            **paged_args(q, out, kv_cache, seqs, block_tables),
            scale=scale,
            **tail_args(lse, row_map, merge),
        )
