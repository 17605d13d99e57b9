"""The native paged attention as ``torch.library`` operators, so ``torch.compile``
keeps it opaque (compiled decode steps call these).

An operator's arguments are tensors and numbers, so it cannot carry the runner's
:class:`~kvserve.model.kernels.backend.KernelBackend`: it uses the process default
(:func:`~kvserve.model.kernels.backend.default_backend`), the one the runner chooses
from the same switches. Callers choose the backend first: the operators raise
RuntimeError where native attention is off.
"""

from __future__ import annotations

import torch

from kvserve.model.kernels.backend import default_backend


@torch.library.custom_op("kvserve::paged_attention", mutates_args=())
def paged_attention_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seqs: torch.Tensor,
    block_tables: torch.Tensor,
    kv_segment_size: int,
    scale: float,
) -> torch.Tensor:
    """:class:`~kvserve.model.kernels.paged_attention.PagedAttention` as an operator
    (same contract); RuntimeError where native attention is off."""
    kernel = default_backend().attention
    if kernel is None:
        raise RuntimeError("native paged attention is off (see docs/kernels.md)")
    if q.stride(-1) != 1:
        q = q.contiguous()
    return kernel(q, kv_cache, seqs, block_tables, kv_segment_size, scale)


@paged_attention_op.register_fake
def _(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seqs: torch.Tensor,
    block_tables: torch.Tensor,
    kv_segment_size: int,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op("kvserve::write_kv_and_attend", mutates_args=("kv_cache",))
def write_kv_and_attend_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    write_slots: torch.Tensor,
    seqs: torch.Tensor,
    block_tables: torch.Tensor,
    kv_segment_size: int,
    scale: float,
) -> torch.Tensor:
    """Write the step's K/V [T, Hk, D] to ``write_slots`` [T] of ``kv_cache`` (in place),
    then :func:`paged_attention_op`. One operator, so that a compiled graph mutates the
    cache where it lies: an in-place write followed by a separate read made inductor
    copy each layer's whole cache twice per step."""
    flat = kv_cache.view(2, kv_cache.shape[1], -1, kv_cache.shape[-1])  # [2, Hk, slots, D]
    flat[0].index_copy_(1, write_slots, k.transpose(0, 1))
    flat[1].index_copy_(1, write_slots, v.transpose(0, 1))
    return paged_attention_op(q, kv_cache, seqs, block_tables, kv_segment_size, scale)


@write_kv_and_attend_op.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    write_slots: torch.Tensor,
    seqs: torch.Tensor,
    block_tables: torch.Tensor,
    kv_segment_size: int,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)
