"""Batch-invariant attention on the prefill kernel's speed (docs/determinism.md).

The paged kernel (``csrc/paged_attention.cpp``) fixes each row's arithmetic by
absolute positions, so a row computed there is the same bits in any chunk, batch or
grouping; but its multi-row tiles run about 1.5x slower than the vector prefill
kernel. ``kvs_prefill_attention_inv`` (``csrc/prefill_vec.cpp``,
:meth:`PrefillVec.invariant`) computes exactly the paged kernel's per-row numbers with
the rows in the vector lanes, so the multi-row requests of an invariant call can run
there instead: :func:`attend_invariant`. Where it is usable and no AMX kernel serves
prefill, the automatic mode reaches :data:`AUTO_INVARIANT_MAX_CONTEXT_VEC` tokens
(:func:`auto_invariant_reach`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.model.attention_metadata import AUTO_INVARIANT_MAX_CONTEXT

if TYPE_CHECKING:
    from kvserve.model.attention_metadata import NativeBatch
    from kvserve.model.kernels.backend import KernelBackend

# The automatic mode's reach where the invariant prefill kernel serves: requests whose
# context (prompt + generated) is at most this many tokens are batch invariant by
# default. Past it, the fast kernels and cascade attention serve them (rows
# within the reach are never cascade-grouped: the cascade's split at the shared prefix
# changes a row's sum order). Measured cost: docs/determinism.md.
AUTO_INVARIANT_MAX_CONTEXT_VEC = 4096


def auto_invariant_reach(
    kernels: KernelBackend, dtype: torch.dtype, head_dim: int, block_size: int, seg: int
) -> int:
    """The automatic mode's reach for these kernels and shapes:
    :data:`AUTO_INVARIANT_MAX_CONTEXT_VEC` where the invariant prefill kernel runs
    (AVX-512, even block and segment sizes) and the AMX prefill kernel does not serve
    this dtype (its prefill speed was not measured against it: Intel CPUs keep 512),
    else ``AUTO_INVARIANT_MAX_CONTEXT``."""
    vec, amx = kernels.prefill_vec, kernels.prefill_amx
    if amx is not None and amx.supports(dtype, head_dim, block_size):
        return AUTO_INVARIANT_MAX_CONTEXT
    if vec is not None and vec.supports_invariant(dtype, head_dim, block_size, seg):
        return AUTO_INVARIANT_MAX_CONTEXT_VEC
    return AUTO_INVARIANT_MAX_CONTEXT


def attend_invariant(
    nb: NativeBatch,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seqs: torch.Tensor,
    tables: torch.Tensor,
    seg: int,
    scale: float,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """``nb.kernel(q, kv_cache, seqs, tables, seg, scale, lse=lse)``, bitwise, with the
    multi-row requests of ``seqs`` on :meth:`PrefillVec.invariant` where it runs for
    q's dtype and shape (the one-row requests stay on the paged kernel). Rules: those
    of the paged kernel's call (no merge); every row of q belongs to one of ``seqs``.
    The split of ``seqs`` is cached on ``nb`` (one step's metadata) per tensor."""
    vec = nb.prefill_vec
    if (
        vec is None
        or kv_cache.dtype != q.dtype
        or not vec.supports_invariant(q.dtype, q.shape[-1], kv_cache.shape[3], seg)
    ):
        return nb.kernel(q, kv_cache, seqs, tables, seg, scale, lse=lse)
    cache: dict[int, tuple[torch.Tensor, ...] | None] = nb.__dict__.setdefault("_inv_split", {})
    key = id(seqs)
    if key not in cache:
        multi = seqs[:, 1] > 1
        if not bool(multi.any()):
            cache[key] = None
        else:
            one = ~multi
            cache[key] = (
                seqs[one].contiguous(),
                tables[one].contiguous(),
                seqs[multi].contiguous(),
                tables[multi].contiguous(),
            )
    split = cache[key]
    if split is None:
        return nb.kernel(q, kv_cache, seqs, tables, seg, scale, lse=lse)
    one_seqs, one_tables, multi_seqs, multi_tables = split
    if one_seqs.shape[0]:
        out = nb.kernel(q, kv_cache, one_seqs, one_tables, seg, scale, lse=lse)
    else:
        out = torch.empty(q.shape, dtype=q.dtype)
    vec.invariant(q, kv_cache, multi_seqs, multi_tables, seg, scale, out, lse=lse)
    return out
