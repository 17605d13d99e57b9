"""The target's K/V rows for a draft model of the same checkpoint.

**The target's KV instead of a catch-up** (``DraftModelProposer.attach_target``). A draft with the
same weights as the target at lower precision (the shipped 4-bit file drafting for
its bfloat16 target) has the target's architecture, so the catch-up, which costs as
much compute as the target's own prefill (a 250-token prompt: about 30 target decode
steps here, more than 96 output tokens earn back), is replaced by a copy of the
target's K/V rows into the draft's blocks::

    history  [ .............................. | t ]   t: sampled this step, no KV yet
    target KV valid for every position before t (all a sampling request's earlier
    tokens were computed: its prefill, its accepted drafts)
    draft:   copy rows [c, n-1) from the target's blocks, then forward t alone

so each proposal's first forward is one row per request and a new request needs no
prefill at all (none is deferred). The draft then attends to the target's K/V for
the history, its own for its drafts: acceptance, not exactness, depends on it (the
verifier is exact for any proposal). It is used when the runner attaches its cache
and the draft matches: same layer count, KV heads, head size, block size and cache
dtype (an 8-bit target cache does not match), and the same norm weights in every
layer (the same checkpoint, not just the same shape); ``share_target_kv: false`` in
the config turns it off.

Rules for callers: :func:`caches_match` before any :func:`copy_rows`; the block tables
given to :func:`copy_rows` must cover every copied position in both caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def caches_match(theirs: torch.Tensor, mine: torch.Tensor) -> bool:
    """Whether rows of ``theirs`` (the target's cache, layout of
    :mod:`kvserve.model.kv_cache_tensor`) can be copied into ``mine`` as they are:
    same layers, K/V, KV heads, block size and head size, dtype and device (an 8-bit
    target cache does not match a float draft cache), both contiguous."""
    return (
        theirs.dim() == mine.dim() == 6
        and theirs.dtype == mine.dtype
        and theirs.device == mine.device
        and theirs.shape[:3] == mine.shape[:3]
        and theirs.shape[4:] == mine.shape[4:]
        and theirs.is_contiguous()
        and mine.is_contiguous()
    )


def flat_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """``kv_cache`` viewed as ``[L, 2, Hk, blocks * block_size, D]`` (one row a slot)."""
    L, two, hk, nb, bs, d = kv_cache.shape
    return kv_cache.view(L, two, hk, nb * bs, d)


def copy_rows(
    src_flat: torch.Tensor,
    dst_cache: torch.Tensor,
    copies: list[tuple[Sequence[int], list[int], int, int]],
    block_size: int,
    device: Any,
) -> int:
    """Copy K/V rows of positions ``[start, end)`` from the source blocks ``tb``
    (``src_flat``: :func:`flat_rows` of the target's cache) into the destination
    blocks ``db`` of ``dst_cache``, for each ``(tb, db, start, end)``, in one gather and
    one scatter over all layers. Returns the rows copied."""
    src: list[int] = []
    dst: list[int] = []
    for tb, db, start, end in copies:
        for p in range(start, end):
            b, o = divmod(p, block_size)
            src.append(tb[b] * block_size + o)
            dst.append(db[b] * block_size + o)
    if not src:
        return 0
    rows = src_flat.index_select(3, torch.tensor(src, dtype=torch.long, device=device))
    flat_rows(dst_cache).index_copy_(3, torch.tensor(dst, dtype=torch.long, device=device), rows)
    return len(src)


def same_norm_weights(draft: Any, target: Any) -> bool:
    """Whether ``draft`` and ``target`` carry the same checkpoint (at any precision):
    the same layer count and equal RMSNorm weights in every layer and at the end
    (norms stay unquantized in GGUF files; two different checkpoints of one shape do
    not share them). Then the target's K/V are what the draft would compute, up to
    its weights' rounding."""
    dl, tl = getattr(draft, "layers", None), getattr(target, "layers", None)
    if dl is None or tl is None or len(dl) != len(tl):
        return False
    pairs = [(draft.norm, target.norm)]
    for a, b in zip(dl, tl, strict=True):
        pairs.append((a.input_layernorm, b.input_layernorm))
        pairs.append((a.post_attention_layernorm, b.post_attention_layernorm))
    for a, b in pairs:
        if a.shape != b.shape:
            return False
        x, y = a.detach().float(), b.detach().float()
        if not torch.allclose(x, y, rtol=1e-2, atol=1e-2 * float(y.abs().max()) + 1e-6):
            return False
    return True
