"""Attention over the paged KV cache: KV writes, segmented prefill, batched decode.

KV cache layout, one tensor per layer (the model runner allocates them), head-major
so that gathered blocks are contiguous per (head, request) and feed the attention
matmuls without another copy::

    kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim]   # [0] = K, [1] = V
    slot s  = block_id * block_size + offset_in_block   (kv_cache.view(2, Hk, -1, D))
    block 0 = the null block: block tables are padded with 0, real tokens never
              write to it, dummy decode rows read from it.

The model works on a flat batch of ``num_tokens`` rows (tokens of many requests, no
``[batch, max_len]`` padding). Rows are grouped by request, prefill requests first,
then a contiguous decode group (requests with exactly one row) followed by dummy
decode rows::

    rows: [ req A prefill chunk (+pad) | req B prefill chunk | dec C | dec D | dummy ]
           ^ PrefillSeq                  ^ PrefillSeq         ^ DecodeBatch rows ...

Prefill ("segmented"), per request with ``cached_seq_len = c`` and ``n`` new rows::

    keys:  [ seg 0 | seg 1 | ... | partial seg ][ new tokens (causal) ]
           0       S       2S     kS         c c                    c+n

Each segment of ``kv_segment_size`` (S) prior tokens is read from the request's
blocks and attended to without a mask; the partial last segment is masked by
bounding its key range at ``c`` (the keys past ``c`` are never read, which equals a
``-inf`` mask on them). Every part yields an output ``o_i`` and the log-sum-exp
``lse_i = m_i + log(l_i)`` of its scores (running max ``m``, running sum ``l``); the
parts merge exactly with the online-softmax rule ``lse = logaddexp(lse, lse_i)``,
``o = o * exp(lse_old - lse) + o_i * exp(lse_i - lse)``. ``kv_segment_size == 0``
means one pass over all prior KV.

Decode: every decode row attends to its whole context (its own new KV included,
written first).

Two implementations of the same contract, chosen per step by
:func:`build_attention_metadata` (``backend``):

- ``native`` (default where it builds): one call per layer into the C++ kernel of
  :mod:`kvserve.model.kernels.paged_attention` for every row of the batch. Each (request, KV
  head, tile of query rows) walks its own block table and reads K/V where they lie,
  segment by segment with the online-softmax merge above, so no context is copied
  and a row's work is proportional to its own context. Where the CPU has AMX-BF16
  (bfloat16, head_dim 64), prefill chunks go to a second kernel that runs Q.K^T and
  P.V as AMX tile products over the pages, prior and new keys in one pass, 64 keys
  at a time (segments are multiples of 64, so the per-segment merge is the same
  computation); ``KVSERVE_PREFILL_AMX=0`` turns it off. Without AMX the same split
  runs on ``csrc/prefill_vec.cpp`` (AVX-512: vdpbf16ps for bfloat16, fp32 FMAs for
  float32; AVX2: fp32 FMAs; head_dim 32/64/128, any block size), where a row's result
  does not depend on how the prompt was chunked; ``KVSERVE_PREFILL_VEC=0`` turns it off
  (then: the decode kernel for short chunks' prior context, flash for the rest).
- ``portable``: PyTorch ops (gather by slot / by block, SDPA). Decode rows are
  gathered up to the longest context and masked past each row's ``seq_len``. It is
  the reference the tests hold the native kernel to, and the fallback where no C++
  compiler works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model.attention_metadata import (  # noqa: F401  (re-exported)
    NATIVE_PREFILL_MAX_ROWS,
    AttentionBackend,
    AttentionMetadata,
    CascadeSplit,
    DecodeBatch,
    NativeBatch,
    NativePrefill,
    PrefillSeq,
    ResolvedBackend,
    SeqSpec,
    build_attention_metadata,
    resolve_attention_backend,
)
from kvserve.model.invariance import attend_invariant
from kvserve.model.kernels.kv8 import is_kv8, kv8_paged_attention
from kvserve.model.kernels.ops import paged_attention_op, write_kv_and_attend_op

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- kernels


def _attention_lse_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    attn_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Portable (any device) attention returning (out, lse); same shapes as the CPU op."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, T, S]
    if causal:
        t, s = scores.shape[-2:]
        scores = scores.masked_fill(
            torch.ones(t, s, dtype=torch.bool, device=q.device).triu(1), _NEG_INF
        )
    if attn_mask is not None:
        scores = scores + attn_mask
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, T]
    probs = torch.exp(scores - lse[..., None])
    return torch.matmul(probs, v.float()).to(q.dtype), lse


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of each query's scores.

    q: [B, H, T, D]; k, v: [B, Hk, S, D] with H a multiple of Hk (GQA); strided views
    are fine. ``causal`` aligns the top-left corners (T == S for self-attention).
    ``attn_mask``: additive, broadcastable to [B, H, T, S]. Returns
    out [B, H, T, D] and lse [B, H, T] (fp32). Uses PyTorch's fused CPU flash kernel on
    CPU and a portable implementation elsewhere.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=attn_mask, scale=scale
        )
        return out, lse
    return _attention_lse_math(q, k, v, causal, attn_mask, scale)


def merge_attention_states(
    out: torch.Tensor, lse: torch.Tensor, out_i: torch.Tensor, lse_i: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact online-softmax merge of two partial attentions over disjoint key sets.

    out*: [..., T, D], lse*: [..., T]. With ``lse = m + log(l)`` (running max ``m``,
    running sum ``l``), the merged lse is ``logaddexp`` and each output is reweighted by
    its share of the total softmax mass.
    """
    new_lse = torch.logaddexp(lse, lse_i)
    w = torch.exp(lse - new_lse).unsqueeze(-1).to(out.dtype)
    w_i = torch.exp(lse_i - new_lse).unsqueeze(-1).to(out.dtype)
    return out * w + out_i * w_i, new_lse


def segment_bounds(cached_seq_len: int, kv_segment_size: int) -> list[tuple[int, int]]:
    """Token ranges of the prior-KV segments; the last one may be partial.

    >>> segment_bounds(1300, 512)
    [(0, 512), (512, 1024), (1024, 1300)]
    """
    if cached_seq_len <= 0:
        return []
    if kv_segment_size <= 0:
        return [(0, cached_seq_len)]
    return [
        (s, min(s + kv_segment_size, cached_seq_len))
        for s in range(0, cached_seq_len, kv_segment_size)
    ]


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Write the step's new K/V ([num_tokens, Hk, D]) into their slots; padding rows skip."""
    flat = kv_cache.view(2, kv_cache.shape[1], -1, kv_cache.shape[-1])  # [2, Hk, slots, D]
    if meta.write_rows is not None:
        k = k.index_select(0, meta.write_rows)
        v = v.index_select(0, meta.write_rows)
    flat[0].index_copy_(1, meta.write_slots, k.transpose(0, 1))
    flat[1].index_copy_(1, meta.write_slots, v.transpose(0, 1))


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    seq: PrefillSeq,
    kv_segment_size: int,
    scale: float,
) -> torch.Tensor:
    """Segmented prefill attention for one request.

    q: [n, H, D], k/v: [n, Hk, D] (the request's rows, padding last). Attends causally
    among the rows and to all ``seq.cached_seq_len`` prior tokens in the cache, read in
    segments of ``kv_segment_size``. Returns [1, H, n, D].
    """
    qh = q.unsqueeze(0).transpose(1, 2)  # [1, H, n, D]
    out, lse = attention_with_lse(
        qh, k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2), causal=True, scale=scale
    )
    if seq.prior_slots is None:
        return out
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[-1]
    flat = kv_cache.view(2 * num_kv_heads, -1, head_dim)  # [2Hk, slots, D]
    for start, end in segment_bounds(seq.cached_seq_len, kv_segment_size):
        kv = flat.index_select(1, seq.prior_slots[start:end])  # [2Hk, S, D]
        kv = kv.view(2, 1, num_kv_heads, -1, head_dim)  # [2, 1, Hk, S, D]
        out_i, lse_i = attention_with_lse(qh, kv[0], kv[1], causal=False, scale=scale)
        out, lse = merge_attention_states(out, lse, out_i, lse_i)
    return out


def decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    """One query per row against its whole context. q: [B, H, D] -> [B, H, D].

    The rows' blocks are gathered up to the longest context (contiguous per head and
    row thanks to the head-major layout) and masked per row. The ``H / Hk`` query
    heads that share a KV head become that head's query rows, so no KV is repeated.
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    # one copy per block and (K/V, head): index_select on a 3-D view is a plain memcpy
    by_block = kv_cache.view(2 * num_kv_heads, kv_cache.shape[2], -1)  # [2Hk, blocks, bs*D]
    blocks = by_block.index_select(1, batch.block_ids)  # [2Hk, B * max_blocks, bs * D]
    kv = blocks.view(2, num_kv_heads, num_rows, -1, head_dim)  # [2, Hk, B, L, D]
    qg = q.view(num_rows, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hk, B, g, D]
    out = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=batch.attn_mask, scale=scale)
    return out.transpose(0, 1).reshape(num_rows, num_heads, head_dim)  # [B, H, D]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One layer's attention for the whole flat batch.

    q: [T, H, D], k/v: [T, Hk, D] (RoPE applied). Writes the new K/V into the cache
    (skipping padding), then runs segmented prefill per request and one batched decode
    call. Returns [T, H, D]; padding and dummy rows hold meaningless values.
    """
    if is_kv8(kv_cache):  # 8-bit codes + scales: their own write and kernel
        return kv8_paged_attention(q, k, v, kv_cache, meta, scale)
    nb = meta.native
    if nb is not None and torch.compiler.is_compiling():
        if nb.prefills or meta.write_rows is not None:
            raise RuntimeError("compiled steps run decode-only native batches, every row written")
        # one opaque operator that writes the cache in place (no cascade: whole contexts)
        return write_kv_and_attend_op(
            q,
            k,
            v,
            kv_cache,
            meta.write_slots,
            nb.seqs,
            nb.block_tables,
            meta.kv_segment_size,
            scale,
        )
    write_kv(kv_cache, k, v, meta)
    if nb is not None:
        return native_attention(q, k, v, kv_cache, meta, scale)
    if not meta.prefills and meta.decode is not None and meta.decode.token_start == 0:
        return decode_attention(q, kv_cache, meta.decode, scale)
    out = torch.empty_like(q)
    for seq in meta.prefills:
        rows = slice(seq.token_start, seq.token_start + seq.num_rows)
        o = prefill_attention(q[rows], k[rows], v[rows], kv_cache, seq, meta.kv_segment_size, scale)
        out[rows] = o[0].transpose(0, 1)
    if meta.decode is not None:
        d = meta.decode
        rows = slice(d.token_start, d.token_start + d.num_rows)
        out[rows] = decode_attention(q[rows], kv_cache, d, scale)
    return out


def native_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of a native-metadata batch whose K/V are already in the cache.

    q: [T, H, D], k/v: [T, Hk, D] (the step's new K/V, RoPE applied; rows may be
    strided). With the AMX prefill kernel usable (``PrefillAmx.supports``): one call
    for the decode rows, one for every prefill request whole. Otherwise one kernel
    call covers every decode row and the prior context of short prefill chunks (see
    :class:`NativeBatch`); each prefill's new tokens then attend causally among
    themselves and merge with the prior part. Returns [T, H, D].
    """
    nb = meta.native
    assert nb is not None
    seg = meta.kv_segment_size
    if torch.compiler.is_compiling():
        if nb.prefills:
            raise RuntimeError("compiled steps run decode-only native batches")
        # an opaque operator inside compiled graphs (no cascade: whole contexts)
        return paged_attention_op(q, kv_cache, nb.seqs, nb.block_tables, seg, scale)
    amx = (
        (nb.prefills or nb.cascade is not None)
        and nb.prefill_amx is not None
        and nb.prefill_amx.supports(q.dtype, q.shape[-1], kv_cache.shape[3])
    )
    if amx:
        return _native_attention_amx(q, kv_cache, nb, seg, scale)
    if (
        (nb.prefills or nb.cascade is not None)
        and nb.prefill_vec is not None
        and nb.prefill_vec.supports(q.dtype, q.shape[-1])
    ):
        return _native_attention_amx(q, kv_cache, nb, seg, scale, vec=True)
    if not nb.prefills:
        c = nb.cascade
        if c is None:  # (the full invariant mode's prefills too: see attend_invariant)
            return attend_invariant(nb, q, kv_cache, nb.seqs, nb.block_tables, seg, scale)
        # cascade on the vector kernel: suffixes, then each group's prefix with its
        # members' rows as one seq (K/V read once per row tile), merged into them
        suffix_lse = torch.full(q.shape[:2], _NEG_INF, dtype=torch.float32)
        out = nb.kernel(q, kv_cache, c.decode_seqs, c.decode_tables, seg, scale, lse=suffix_lse)
        nb.kernel(
            q,
            kv_cache,
            c.group_seqs,
            c.group_tables,
            seg,
            scale,
            lse=suffix_lse,
            row_map=c.row_map,
            out=out,
        )
        return out
    native_prior = any(
        p.native_prior and not p.whole and p.seq.cached_seq_len > 0 for p in nb.prefills
    )
    lse = torch.full(q.shape[:2], _NEG_INF, dtype=torch.float32) if native_prior else None
    if nb.seqs.shape[0]:
        out = nb.kernel(q, kv_cache, nb.seqs, nb.block_tables, seg, scale, lse=lse)
    else:
        out = torch.empty(q.shape, dtype=q.dtype)
    for p in nb.prefills:
        if p.whole:  # the kernel call above covered these rows entirely
            continue
        s = p.seq
        rows = slice(s.token_start, s.token_start + s.num_rows)
        if not p.native_prior:  # causal part + prior segments gathered for flash
            o = prefill_attention(q[rows], k[rows], v[rows], kv_cache, s, seg, scale)
            out[rows] = o[0].transpose(0, 1)
            continue
        o, o_lse = attention_with_lse(
            q[rows].unsqueeze(0).transpose(1, 2),  # [1, H, n, D]
            k[rows].unsqueeze(0).transpose(1, 2),
            v[rows].unsqueeze(0).transpose(1, 2),
            causal=True,
            scale=scale,
        )
        if s.cached_seq_len > 0:
            assert lse is not None
            prior = out[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            prior_lse = lse[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n]
            o, _ = merge_attention_states(o, o_lse, prior, prior_lse)
        out[rows] = o[0].transpose(0, 1)
    return out


def _native_attention_amx(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    nb: NativeBatch,
    seg: int,
    scale: float,
    vec: bool = False,
) -> torch.Tensor:
    """The AMX split of a native batch: decode rows through the vector kernel (grouped
    rows over their own suffix only), then every prefill request whole, then each
    shared-prefix group's prefix merged into its rows (see :class:`CascadeSplit`).
    ``vec``: the prefill parts run on the AVX-512/AVX2 prefill kernel (CPUs without
    AMX, any dtype the kernel takes) instead of AMX tiles; same split, same contract."""
    prefill = nb.prefill_vec if vec else nb.prefill_amx
    assert prefill is not None
    c = nb.cascade
    if c is not None:
        decode_seqs, decode_tables = c.decode_seqs, c.decode_tables
    else:
        assert nb.decode_seqs is not None and nb.decode_tables is not None
        decode_seqs, decode_tables = nb.decode_seqs, nb.decode_tables
    lse = torch.full(q.shape[:2], _NEG_INF, dtype=torch.float32) if c is not None else None
    if decode_seqs.shape[0]:  # (with the invariant prefills: see attend_invariant)
        out = attend_invariant(nb, q, kv_cache, decode_seqs, decode_tables, seg, scale, lse=lse)
    else:
        out = torch.empty(q.shape, dtype=q.dtype)
    if nb.prefill_seqs is not None and nb.prefill_seqs.shape[0]:
        assert nb.prefill_tables is not None
        prefill(q, kv_cache, nb.prefill_seqs, nb.prefill_tables, scale, out)
    if c is not None:
        prefill(q, kv_cache, c.group_seqs, c.group_tables, scale, out, lse, c.row_map, merge=True)
    return out
