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
  :mod:`kvserve.model.native` for every row of the batch. Each (request, KV
  head, tile of query rows) walks its own block table and reads K/V where they lie,
  segment by segment with the online-softmax merge above, so no context is copied
  and a row's work is proportional to its own context.
- ``portable``: PyTorch ops (gather by slot / by block, SDPA). Decode rows are
  gathered up to the longest context and masked past each row's ``seq_len``. It is
  the reference the tests hold the native kernel to, and the fallback where no C++
  compiler works.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.model.native import PagedAttentionKernel, get_kernel, paged_attention_op

AttentionBackend = Literal["auto", "native", "portable"]
ResolvedBackend = Literal["native", "portable"]
_NEG_INF = float("-inf")


@dataclass
class SeqSpec:
    """One request's rows in the flat batch (plain data, input to the metadata builder).

    Rules: ``num_tokens <= num_rows``; rows past ``num_tokens`` are padding (they
    write no KV and their outputs mean nothing); ``block_ids`` covers positions
    ``[0, cached_seq_len + num_tokens)``.
    """

    token_start: int
    num_rows: int
    num_tokens: int
    cached_seq_len: int
    block_ids: Sequence[int]


@dataclass
class PrefillSeq:
    """A request with more than one row: segmented prefill attention."""

    token_start: int
    num_rows: int
    cached_seq_len: int
    prior_slots: torch.Tensor | None  # [cached_seq_len] int64 slots of the prior tokens


@dataclass
class DecodeBatch:
    """Rows ``[token_start, token_start + num_rows)``: one query token each."""

    token_start: int
    num_rows: int  # real decode rows + dummy rows
    block_ids: torch.Tensor  # [num_rows * max_blocks] int64, row-major block tables, 0 = null
    max_blocks: int
    attn_mask: torch.Tensor  # [1, num_rows, 1, max_blocks * block_size] 0 / -inf


# Prefill chunks with fewer rows than this read their prior context in place through
# the native kernel; longer chunks gather it segment by segment for PyTorch's fused
# flash kernel (its AMX/oneDNN GEMMs beat the kernel's vector loop from 16 rows on:
# 2.45 vs 1.27 ms per layer at 64 rows x 1,024 prior tokens, bf16, this machine kind).
NATIVE_PREFILL_MAX_ROWS = 16


@dataclass
class NativePrefill:
    """One prefill request of a native batch; ``native_prior``: who reads its prior KV.

    ``native_prior``: the kernel covered ``[0, cached_seq_len)`` in place and left the
    rows' output and log-sum-exp; otherwise ``seq.prior_slots`` is gathered segment by
    segment (``prefill_attention``).
    """

    seq: PrefillSeq
    native_prior: bool


@dataclass
class NativeBatch:
    """The native kernel's view of the whole batch.

    Decode rows (and dummy rows) attend to their whole context through the pages in
    one kernel call. Short prefill chunks are in that call too, marked prior-only:
    the kernel covers their prior context in segments and returns its log-sum-exp.
    Every prefill's new tokens attend among themselves through PyTorch's fused causal
    kernel, and the parts merge exactly (:class:`NativePrefill`).
    """

    kernel: PagedAttentionKernel
    seqs: torch.Tensor  # [S, 5] int64: row_start, num_rows, num_tokens, cached_seq_len, prior_only
    block_tables: torch.Tensor  # [S, max_blocks] int64, 0 = null block
    prefills: list[NativePrefill]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers.

    Exactly one of ``native`` and (``prefills``, ``decode``) is in use: with
    ``native`` set the lists are empty and ``decode`` is None.
    """

    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding (not written)
    write_rows: torch.Tensor | None  # [num_writes] rows whose KV is written; None = all rows
    write_slots: torch.Tensor  # [num_writes] int64 target slots
    prefills: list[PrefillSeq]
    decode: DecodeBatch | None
    block_size: int
    kv_segment_size: int
    native: NativeBatch | None = None


def _token_slots(block_ids: np.ndarray, start: int, end: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, end, dtype=np.int64)
    return block_ids[pos // block_size] * block_size + pos % block_size


def resolve_attention_backend(
    kv_dtype: torch.dtype, device: torch.device | str = "cpu"
) -> ResolvedBackend:
    """``"native"`` when the C++ kernel is built and handles ``kv_dtype`` on ``device``."""
    kernel = get_kernel()
    native = (
        kernel is not None
        and torch.device(device).type == "cpu"
        and PagedAttentionKernel.supports(kv_dtype)
    )
    return "native" if native else "portable"


def build_attention_metadata(
    seqs: Sequence[SeqSpec],
    *,
    num_tokens: int,
    num_dummy_decode_rows: int = 0,
    block_size: int,
    kv_segment_size: int,
    device: torch.device | str = "cpu",
    backend: AttentionBackend = "auto",
    kv_dtype: torch.dtype = torch.float32,
) -> AttentionMetadata:
    """Build per-step attention metadata from plain per-request specs.

    Rules a caller must keep: ``seqs`` are in flat-batch order, contiguous, prefill
    requests (``num_rows > 1``) before one-row requests; the ``num_dummy_decode_rows``
    dummy rows come right after the last one-row request and are the last rows;
    ``num_tokens`` equals the total of rows. Dummy rows attend to slot 0 of the null
    block and write nothing.

    ``backend``: ``"auto"`` picks the native kernel when it is available for
    ``kv_dtype`` on ``device`` (CPU, float32/bfloat16) and the portable path otherwise;
    ``"native"`` raises RuntimeError when the kernel is unavailable; ``"portable"``
    always uses PyTorch ops.
    """
    if kv_segment_size < 0:
        raise ValueError(f"kv_segment_size={kv_segment_size} must be >= 0 (0 = one pass)")
    if backend not in ("auto", "native", "portable"):
        raise ValueError(f"backend={backend!r}: use 'auto', 'native' or 'portable'")
    kernel = None
    if backend != "portable":
        if resolve_attention_backend(kv_dtype, device) == "native":
            kernel = get_kernel()
        elif backend == "native":
            raise RuntimeError(
                f"native paged attention is unavailable for {kv_dtype} on {device} "
                "(needs a C++ compiler, the CPU and float32/bfloat16): use backend='auto'"
            )
    if kernel is not None:
        return _build_native(
            seqs, kernel, num_tokens, num_dummy_decode_rows, block_size, kv_segment_size
        )
    slot_mapping = np.full(num_tokens, -1, dtype=np.int64)
    prefills: list[PrefillSeq] = []
    decode_seqs: list[SeqSpec] = []
    row = 0
    for s in seqs:
        if s.token_start != row or s.num_tokens > s.num_rows or s.num_tokens < 1:
            raise ValueError(
                f"bad SeqSpec {s}: rows must be contiguous, 1 <= num_tokens <= num_rows"
            )
        row += s.num_rows
        bt = np.asarray(s.block_ids, dtype=np.int64)
        end = s.cached_seq_len + s.num_tokens
        if len(bt) * block_size < end:
            raise ValueError(
                f"SeqSpec at row {s.token_start} has {len(bt)} blocks for {end} tokens "
                f"(block_size={block_size})"
            )
        slot_mapping[s.token_start : s.token_start + s.num_tokens] = _token_slots(
            bt, s.cached_seq_len, end, block_size
        )
        if s.num_rows > 1:
            if decode_seqs:
                raise ValueError(
                    "prefill requests (num_rows > 1) must come before one-row requests"
                )
            prior = None
            if s.cached_seq_len > 0:
                prior = torch.from_numpy(_token_slots(bt, 0, s.cached_seq_len, block_size))
                prior = prior.to(device)
            prefills.append(PrefillSeq(s.token_start, s.num_rows, s.cached_seq_len, prior))
        else:
            decode_seqs.append(s)
    if row + num_dummy_decode_rows != num_tokens:
        raise ValueError(
            f"rows {row} + dummy rows {num_dummy_decode_rows} != num_tokens {num_tokens}"
        )

    decode = None
    num_decode_rows = len(decode_seqs) + num_dummy_decode_rows
    if num_decode_rows:
        seq_lens = [s.cached_seq_len + 1 for s in decode_seqs] + [1] * num_dummy_decode_rows
        max_blocks = max(-(-n // block_size) for n in seq_lens)
        table = np.zeros((num_decode_rows, max_blocks), dtype=np.int64)
        for i, s in enumerate(decode_seqs):
            nb = -(-(s.cached_seq_len + 1) // block_size)
            table[i, :nb] = np.asarray(s.block_ids[:nb], dtype=np.int64)
        cols = torch.arange(max_blocks * block_size)
        lens = torch.tensor(seq_lens)
        mask = torch.zeros(1, num_decode_rows, 1, max_blocks * block_size)
        mask.masked_fill_((cols[None, :] >= lens[:, None])[None, :, None, :], _NEG_INF)
        decode = DecodeBatch(
            token_start=decode_seqs[0].token_start if decode_seqs else row,
            num_rows=num_decode_rows,
            block_ids=torch.from_numpy(table.reshape(-1)).to(device),
            max_blocks=max_blocks,
            attn_mask=mask.to(device),
        )

    slots_t = torch.from_numpy(slot_mapping)
    valid = slot_mapping >= 0
    if valid.all():
        write_rows = None
        write_slots = slots_t.to(device)
    else:
        write_rows = torch.from_numpy(np.nonzero(valid)[0].astype(np.int64)).to(device)
        write_slots = torch.from_numpy(slot_mapping[valid]).to(device)
    return AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=slots_t.to(device),
        write_rows=write_rows,
        write_slots=write_slots,
        prefills=prefills,
        decode=decode,
        block_size=block_size,
        kv_segment_size=kv_segment_size,
    )


def _build_native(
    seqs: Sequence[SeqSpec],
    kernel: PagedAttentionKernel,
    num_tokens: int,
    num_dummy: int,
    block_size: int,
    kv_segment_size: int,
) -> AttentionMetadata:
    """Native-kernel metadata: per-request rows, block tables, KV write slots."""
    num_seqs = len(seqs) + num_dummy
    info = np.zeros((num_seqs, 5), dtype=np.int64)
    prefills: list[NativePrefill] = []
    in_kernel = np.ones(num_seqs, dtype=bool)
    nblocks = [-(-(s.cached_seq_len + s.num_tokens) // block_size) for s in seqs]
    table = np.zeros((num_seqs, max([1, *nblocks])), dtype=np.int64)
    slot_mapping = np.full(num_tokens, -1, dtype=np.int64)
    row = 0
    seen_single = False
    for i, s in enumerate(seqs):
        if s.token_start != row or s.num_tokens > s.num_rows or s.num_tokens < 1:
            raise ValueError(
                f"bad SeqSpec {s}: rows must be contiguous, 1 <= num_tokens <= num_rows"
            )
        if s.num_rows > 1 and seen_single:
            raise ValueError("prefill requests (num_rows > 1) must come before one-row requests")
        seen_single = seen_single or s.num_rows == 1
        nb = nblocks[i]
        if len(s.block_ids) < nb:
            raise ValueError(
                f"SeqSpec at row {s.token_start} has {len(s.block_ids)} blocks for "
                f"{s.cached_seq_len + s.num_tokens} tokens (block_size={block_size})"
            )
        bt = np.asarray(s.block_ids[:nb], dtype=np.int64)
        table[i, :nb] = bt
        prior_only = int(s.num_rows > 1)
        info[i] = (row, s.num_rows, s.num_tokens, s.cached_seq_len, prior_only)
        if prior_only:
            native_prior = s.num_rows < NATIVE_PREFILL_MAX_ROWS
            in_kernel[i] = native_prior
            prior = None
            if s.cached_seq_len > 0 and not native_prior:
                prior = torch.from_numpy(_token_slots(bt, 0, s.cached_seq_len, block_size))
            prefills.append(
                NativePrefill(PrefillSeq(row, s.num_rows, s.cached_seq_len, prior), native_prior)
            )
        slot_mapping[row : row + s.num_tokens] = _token_slots(
            bt, s.cached_seq_len, s.cached_seq_len + s.num_tokens, block_size
        )
        row += s.num_rows
    if row + num_dummy != num_tokens:
        raise ValueError(f"rows {row} + dummy rows {num_dummy} != num_tokens {num_tokens}")
    for j in range(num_dummy):  # one token at position 0 of the null block
        info[len(seqs) + j] = (row + j, 1, 1, 0, 0)
    valid = slot_mapping >= 0
    slots_t = torch.from_numpy(slot_mapping)
    if valid.all():
        write_rows, write_slots = None, slots_t
    else:
        write_rows = torch.from_numpy(np.nonzero(valid)[0].astype(np.int64))
        write_slots = torch.from_numpy(slot_mapping[valid])
    return AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=slots_t,
        write_rows=write_rows,
        write_slots=write_slots,
        prefills=[],
        decode=None,
        block_size=block_size,
        kv_segment_size=kv_segment_size,
        native=NativeBatch(
            kernel,
            torch.from_numpy(np.ascontiguousarray(info[in_kernel])),
            torch.from_numpy(np.ascontiguousarray(table[in_kernel])),
            prefills,
        ),
    )


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
    write_kv(kv_cache, k, v, meta)
    if meta.native is not None:
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
    strided). One kernel call covers every decode row and the prior context of every
    prefill request (see :class:`NativeBatch`); each prefill's new tokens then attend
    causally among themselves and merge with the prior part. Returns [T, H, D].
    """
    nb = meta.native
    assert nb is not None
    seg = meta.kv_segment_size
    compiling = torch.compiler.is_compiling()
    if not nb.prefills:
        if compiling:  # an opaque operator inside compiled graphs
            return paged_attention_op(q, kv_cache, nb.seqs, nb.block_tables, seg, scale)
        return nb.kernel(q, kv_cache, nb.seqs, nb.block_tables, seg, scale)
    if compiling:
        raise RuntimeError("compiled steps run decode-only native batches")
    native_prior = any(p.native_prior and p.seq.cached_seq_len > 0 for p in nb.prefills)
    lse = torch.full(q.shape[:2], _NEG_INF, dtype=torch.float32) if native_prior else None
    if nb.seqs.shape[0]:
        out = nb.kernel(q, kv_cache, nb.seqs, nb.block_tables, seg, scale, lse=lse)
    else:
        out = torch.empty(q.shape, dtype=q.dtype)
    for p in nb.prefills:
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
