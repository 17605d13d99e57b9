"""Per-step attention metadata: what every layer's attention reads, built once a step.

Plain per-request specs (:class:`SeqSpec`) come in from the model runner; out comes
:class:`AttentionMetadata` for the native kernel (:class:`NativeBatch`) or the
portable PyTorch path (:class:`PrefillSeq` list + :class:`DecodeBatch`). The layout
and the segmented-prefill rules are described in :mod:`kvserve.model.attention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kvserve.model.kernels.backend import KernelBackend, default_backend
from kvserve.model.kernels.paged_attention import PagedAttention
from kvserve.model.kernels.prefill_amx import PrefillAmx
from kvserve.model.kernels.prefill_vec import PrefillVec

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


# Where no prefill kernel runs (AMX or prefill_vec.cpp: see ``native_attention``):
# prefill chunks with fewer rows than this read their prior context in place through
# the native kernel; longer chunks gather it segment by segment for PyTorch's fused
# flash kernel (its AMX/oneDNN GEMMs beat the kernel's vector loop from 16 rows on:
# 2.45 vs 1.27 ms per layer at 64 rows x 1,024 prior tokens, bf16, this machine kind).
NATIVE_PREFILL_MAX_ROWS = 16
# float32 prefill requests with at most NATIVE_WHOLE_MAX_TOKENS new tokens, or whose
# whole context (cached + new) is at most NATIVE_WHOLE_MAX_CONTEXT tokens, run entirely
# in the kernel (prior and causal part in place, no gather, flash call or merge).
# Measured per step of 30 layers (attention ms, kernel whole vs flash split): 16 x 64
# new over 1,024 cached 597 vs 960; 16 x 64 over 3,072 1,710 vs 2,723; 8 x 128 over
# 2,048 1,334 vs 1,456; 2 x 512 over 1,024 648 vs 897; 4 x 256 over 1,536 even; 4 x 512
# new tokens alone 8.6-9.8 vs 14.1 per layer; 1 x 1,024 over 512 593 vs 532 and 1 x
# 2,048 alone 37 vs 29 per layer (flash wins long chunks over long contexts).
# bfloat16 prefills go to the AMX kernel instead.
NATIVE_WHOLE_MAX_TOKENS = 512
NATIVE_WHOLE_MAX_CONTEXT = 1024


@dataclass
class NativePrefill:
    """One prefill request of a native batch; ``native_prior``: who reads its prior KV.

    ``native_prior``: the kernel covered ``[0, cached_seq_len)`` in place and left the
    rows' output and log-sum-exp; otherwise ``seq.prior_slots`` is gathered segment by
    segment (``prefill_attention``). ``whole``: the kernel computed the rows' whole
    attention (prior and causal part), nothing is left
    to do for them (float32 only, see ``NATIVE_WHOLE_MAX_TOKENS``).
    """

    seq: PrefillSeq
    native_prior: bool
    whole: bool = False


# The automatic mode's reach (``invariant_max_context``, docs/determinism.md): prefill
# chunks whose context ends at most this many tokens in run whole in the paged kernel
# (absolute key parts: the decode computation), and rows this short are never cascade-
# grouped, so requests up to this length are batch invariant by default. Longer chunks
# keep the fast prefill kernels (vector/AMX/flash), where invariant attention measured
# (AMD Zen 5, bf16, Q4_1, one thread, CPU clock) 0.86-0.94x on 1,024-token prefills,
# 0.88x on 2,048 and 0.83x on 512 over 2,048 cached, against 0.97-1.05x at 512.
AUTO_INVARIANT_MAX_CONTEXT = 512

# A shared prefix is attended as a cascade group only from this many tokens on (below
# it, the per-row vector kernel reads it just as cheaply).
CASCADE_MIN_SHARED_TOKENS = 64


@dataclass
class CascadeSplit:
    """Decode rows whose requests share their leading KV blocks (prefix-cache hits of
    one system prompt, say), split for cascade attention::

        row i keys:  [ shared blocks (the group's)  | own suffix ... own token ]
                     0                            P                        c_i

    The vector kernel runs every one-row request (and dummy row) with grouped rows
    covering their own suffix only (``decode_seqs`` / ``decode_tables``: block table
    shifted by the P shared blocks, ``cached_seq_len`` reduced by P * block_size) and
    returns each row's log-sum-exp; then each group is one AMX seq (prior_only: its
    rows attend to the P * block_size shared tokens, read once) merged exactly into
    them. Used only where the AMX kernel runs (see ``native_attention``).
    """

    decode_seqs: torch.Tensor  # [Sd, 5] int64, the one-row requests and dummy rows
    decode_tables: torch.Tensor  # [Sd, max_blocks]
    group_seqs: torch.Tensor  # [G, 5]: (start in row_map, n, n, shared tokens, 1)
    group_tables: torch.Tensor  # [G, max shared blocks]
    row_map: torch.Tensor  # [sum of n] int64: the batch rows of each group's members


@dataclass
class NativeBatch:
    """The native kernel's view of the whole batch.

    Decode rows (and dummy rows) attend to their whole context through the pages in
    one kernel call. Short prefill chunks are in that call too, marked prior-only:
    the kernel covers their prior context in segments and returns its log-sum-exp.
    Every prefill's new tokens attend among themselves through PyTorch's fused causal
    kernel, and the parts merge exactly (:class:`NativePrefill`).
    """

    kernel: PagedAttention
    seqs: torch.Tensor  # [S, 5] int64: row_start, num_rows, num_tokens, cached_seq_len, prior_only
    block_tables: torch.Tensor  # [S, max_blocks] int64, 0 = null block
    prefills: list[NativePrefill]
    # The same batch split for the AMX prefill kernel (see ``native_attention``): the
    # one-row requests and dummy rows alone, and every prefill request whole
    # (prior_only 0: its rows attend to prior and new keys in one pass).
    decode_seqs: torch.Tensor | None = None  # [Sd, 5], None when there is no prefill
    decode_tables: torch.Tensor | None = None
    prefill_seqs: torch.Tensor | None = None  # [Sp, 5]
    prefill_tables: torch.Tensor | None = None
    cascade: CascadeSplit | None = None  # None: no shared-prefix group this step
    # the backend's prefill kernels (None: that family is off)
    prefill_amx: PrefillAmx | None = None
    prefill_vec: PrefillVec | None = None


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
    kv_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kernels: KernelBackend | None = None,
) -> ResolvedBackend:
    """``"native"`` when ``kernels`` (default: :func:`default_backend`) has native
    attention and it handles ``kv_dtype`` on ``device``."""
    kernel = (kernels or default_backend()).attention
    native = (
        kernel is not None
        and torch.device(device).type == "cpu"
        and PagedAttention.supports(kv_dtype)
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
    batch_invariant: bool = False,
    kernels: KernelBackend | None = None,
    kv_8bit: bool = False,
    invariant_max_context: int = 0,
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
    always uses PyTorch ops. ``kernels``: the runner's backend (default:
    :func:`default_backend`); its ``attention`` family decides what "available" means.

    ``batch_invariant``: every request runs whole (prior and new keys) in one paged
    kernel call whose key parts are split at absolute positions only (see
    :func:`_invariant_seqs`), so a row's attention is computed the same way whatever
    chunk, batch or prefix grouping it is in (no cascade split, no flash/AMX/vector
    prefill path). Needs the native kernel (else RuntimeError).

    ``invariant_max_context`` (native kernel only; ignored with ``batch_invariant``):
    the same for every position below it: prefill chunks crossing it are split there
    (:func:`_split_at_reach`), the part whose context ends within it runs whole in
    the paged kernel and its rows join no cascade group; the rest takes the fast
    route. So requests of at most this many tokens are invariant. 0: none.

    ``kv_8bit``: the cache is 8-bit (:mod:`kvserve.model.kernels_kv8`): every prefill
    is whole (prior_only 0) in ``native.seqs`` and there is no cascade split, so one
    8-bit kernel call covers every row. Needs the native kernel (else RuntimeError).
    """
    if kv_segment_size < 0:
        raise ValueError(f"kv_segment_size={kv_segment_size} must be >= 0 (0 = one pass)")
    if backend not in ("auto", "native", "portable"):
        raise ValueError(f"backend={backend!r}: use 'auto', 'native' or 'portable'")
    kernels = kernels or default_backend()
    kernel = None
    if backend != "portable":
        if resolve_attention_backend(kv_dtype, device, kernels) == "native":
            kernel = kernels.attention
        elif backend == "native":
            raise RuntimeError(
                f"native paged attention is unavailable for {kv_dtype} on {device} "
                "(needs a C++ compiler, the CPU and float32/bfloat16): use backend='auto'"
            )
    if kv_8bit and kernel is None:
        raise RuntimeError(
            "an 8-bit KV cache needs the native kernel (a C++ compiler, the CPU): use "
            "kv_cache_dtype='auto'"
        )
    if batch_invariant and kernel is None:
        raise RuntimeError(
            "batch_invariant attention needs the native kernel (a C++ compiler, the CPU, "
            "float32/bfloat16): use batch_invariant=False"
        )
    if kernel is not None:
        split_heads: set[int] = set()
        if invariant_max_context > 0 and not batch_invariant and not kv_8bit:
            seqs, split_heads = _split_at_reach(seqs, invariant_max_context)
        meta = _build_native(
            seqs,
            kernels,
            num_tokens,
            num_dummy_decode_rows,
            block_size,
            kv_segment_size,
            kv_dtype,
            kv_8bit,
            0 if batch_invariant else invariant_max_context,
            split_heads,
        )
        if batch_invariant:
            assert meta.native is not None
            meta.native = _invariant_seqs(
                seqs, meta.native, num_dummy_decode_rows, num_tokens, block_size
            )
        return meta
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


def _attention(kernels: KernelBackend) -> PagedAttention:
    assert kernels.attention is not None, "native metadata needs native attention"
    return kernels.attention


def _build_native(
    seqs: Sequence[SeqSpec],
    kernels: KernelBackend,
    num_tokens: int,
    num_dummy: int,
    block_size: int,
    kv_segment_size: int,
    kv_dtype: torch.dtype,
    kv_8bit: bool = False,
    invariant_max_context: int = 0,
    split_heads: set[int] | None = None,
) -> AttentionMetadata:
    """Native-kernel metadata: per-request rows, block tables, KV write slots.

    Requests whose context ends within ``invariant_max_context`` tokens are marked
    invariant: prefill chunks whole in the paged kernel (prior_only 0, with the
    decode rows in the AMX/vector split), rows never cascade-grouped."""
    num_seqs = len(seqs) + num_dummy
    info = np.zeros((num_seqs, 5), dtype=np.int64)
    prefills: list[NativePrefill] = []
    in_kernel = np.ones(num_seqs, dtype=bool)
    invariant = np.zeros(num_seqs, dtype=bool)  # the paged kernel's decode form
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
        # (a piece of a chunk split at the reach may be one row: not a decode request)
        seen_single = seen_single or (s.num_rows == 1 and i not in (split_heads or ()))
        nb = nblocks[i]
        if len(s.block_ids) < nb:
            raise ValueError(
                f"SeqSpec at row {s.token_start} has {len(s.block_ids)} blocks for "
                f"{s.cached_seq_len + s.num_tokens} tokens (block_size={block_size})"
            )
        bt = np.asarray(s.block_ids[:nb], dtype=np.int64)
        table[i, :nb] = bt
        prior_only = int(s.num_rows > 1)
        invariant[i] = s.cached_seq_len + s.num_tokens <= invariant_max_context
        whole = bool(prior_only) and kv_dtype == torch.float32
        whole = whole and (
            s.num_tokens <= NATIVE_WHOLE_MAX_TOKENS
            or s.cached_seq_len + s.num_tokens <= NATIVE_WHOLE_MAX_CONTEXT
        )
        whole = whole or (bool(prior_only) and (kv_8bit or bool(invariant[i])))
        if whole:
            info[i] = (row, s.num_rows, s.num_tokens, s.cached_seq_len, 0)
            prefills.append(
                NativePrefill(PrefillSeq(row, s.num_rows, s.cached_seq_len, None), True, True)
            )
        else:
            info[i] = (row, s.num_rows, s.num_tokens, s.cached_seq_len, prior_only)
        if prior_only and not whole:
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
    amx_split = _amx_split(info, table, invariant) if prefills else (None, None, None, None)
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
            _attention(kernels),
            torch.from_numpy(np.ascontiguousarray(info[in_kernel])),
            torch.from_numpy(np.ascontiguousarray(table[in_kernel])),
            prefills,
            *amx_split,
            cascade=None if kv_8bit else _cascade_split(info, table, block_size, invariant),
            prefill_amx=kernels.prefill_amx,
            prefill_vec=kernels.prefill_vec,
        ),
    )


def _split_at_reach(seqs: Sequence[SeqSpec], reach: int) -> tuple[list[SeqSpec], set[int]]:
    """Prefill chunks that cross position ``reach`` split in two requests there: rows
    at positions below it (context ending within the reach: the invariant form) and
    the rest (the fast kernels; they read the head's keys from the pages, written
    before attention runs). So a position below the reach is computed in decode form
    by whichever request computes it, and the KV a prefix-cache hit reuses there is
    the same bits. Returns the specs and the indices of the split pieces (either may
    be one row without being a decode request)."""
    out: list[SeqSpec] = []
    heads: set[int] = set()
    for s in seqs:
        k = reach - s.cached_seq_len
        if s.num_rows > 1 and 0 < k < s.num_tokens:
            heads.update((len(out), len(out) + 1))
            out.append(SeqSpec(s.token_start, k, k, s.cached_seq_len, s.block_ids))
            out.append(
                SeqSpec(
                    s.token_start + k,
                    s.num_rows - k,
                    s.num_tokens - k,
                    s.cached_seq_len + k,
                    s.block_ids,
                )
            )
        else:
            out.append(s)
    return out, heads


def _invariant_seqs(
    seqs: Sequence[SeqSpec], nb: NativeBatch, num_dummy: int, num_tokens: int, block_size: int
) -> NativeBatch:
    """The batch-invariant view of a native batch: every request whole in one kernel call.

    Each request is the seq ``(token_start, num_rows, num_tokens, cached_seq_len, 0)``
    over its block table: row ``j`` attends to keys ``[0, cached_seq_len + j]`` (the
    step's K/V are written before attention runs), prior and new keys in one walk.
    The paged kernel splits that walk only at absolute positions (``kv_segment_size``
    segments, multiples of 512: ``csrc/paged_attention.cpp``), and keys past a row's
    own limit leave its result unchanged, so a position's attention is bitwise the
    same whether it is a decode row, a row of a prefill chunk of any size or start,
    or next to any other request. Prefill rows keep their row tiles (K/V read once
    per 16 rows). No cascade split, no flash, AMX or vector-prefill kernel. Padding
    rows (``num_tokens < num_rows``) get zero output; dummy rows stay one token at
    the null block.
    """
    info = np.zeros((len(seqs) + num_dummy, 5), dtype=np.int64)
    need = [-(-(s.cached_seq_len + s.num_tokens) // block_size) for s in seqs]
    table = np.zeros((len(seqs) + num_dummy, max([1, *need])), dtype=np.int64)
    for i, s in enumerate(seqs):
        info[i] = (s.token_start, s.num_rows, s.num_tokens, s.cached_seq_len, 0)
        table[i, : need[i]] = np.asarray(s.block_ids[: need[i]], dtype=np.int64)
    row = sum(s.num_rows for s in seqs)
    for j in range(num_dummy):
        info[len(seqs) + j] = (row + j, 1, 1, 0, 0)
    assert row + num_dummy == num_tokens
    return NativeBatch(nb.kernel, torch.from_numpy(info), torch.from_numpy(table), [])


def _cascade_split(
    info: np.ndarray, table: np.ndarray, block_size: int, invariant: np.ndarray | None = None
) -> CascadeSplit | None:
    """Group one-row requests by their shared leading blocks (see :class:`CascadeSplit`).

    Rows are grouped by their first block; a group of two or more whose common leading
    blocks (all full and before every member's own token) hold at least
    ``CASCADE_MIN_SHARED_TOKENS`` tokens becomes a cascade group. None when none does.
    ``invariant`` rows are never grouped; the invariant prefill requests run with the
    one-row requests (whole, in the vector kernel).
    """
    inv = np.zeros(len(info), dtype=bool) if invariant is None else invariant
    one_row = np.nonzero((info[:, 1] == 1) | inv)[0]
    # full blocks strictly before the row's own token (cached_seq_len tokens precede it)
    max_shared = info[one_row, 3] // block_size
    candidates = one_row[(max_shared > 0) & (info[one_row, 1] == 1) & ~inv[one_row]]
    if len(candidates) < 2:
        return None
    by_first: dict[int, list[int]] = {}
    for i in candidates.tolist():
        by_first.setdefault(int(table[i, 0]), []).append(i)
    groups: list[tuple[list[int], int]] = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        limit = int((info[members, 3] // block_size).min())
        rows = table[members, :limit]
        same = (rows == rows[0]).all(axis=0)
        shared = limit if same.all() else int(np.argmin(same))
        if shared * block_size >= CASCADE_MIN_SHARED_TOKENS:
            groups.append((members, shared))
    if not groups:
        return None
    dec_info = info[one_row].copy()
    dec_table = table[one_row].copy()
    position = {int(r): k for k, r in enumerate(one_row)}
    group_info = np.zeros((len(groups), 5), dtype=np.int64)
    group_table = np.zeros((len(groups), max(sh for _, sh in groups)), dtype=np.int64)
    row_map: list[int] = []
    for gi, (members, shared) in enumerate(groups):
        group_info[gi] = (len(row_map), len(members), len(members), shared * block_size, 1)
        group_table[gi, :shared] = table[members[0], :shared]
        for i in members:
            k = position[i]
            dec_info[k, 3] -= shared * block_size
            dec_table[k] = np.concatenate([table[i, shared:], np.zeros(shared, dtype=np.int64)])
            row_map.append(int(info[i, 0]))
    return CascadeSplit(
        torch.from_numpy(dec_info),
        torch.from_numpy(dec_table),
        torch.from_numpy(group_info),
        torch.from_numpy(group_table),
        torch.tensor(row_map, dtype=torch.int64),
    )


def _amx_split(
    info: np.ndarray, table: np.ndarray, invariant: np.ndarray | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(decode seqs, their tables, prefill seqs with prior_only 0, their tables);
    ``invariant`` prefill requests go with the decode seqs (the paged kernel)."""
    is_prefill = info[:, 1] > 1
    if invariant is not None:
        is_prefill &= ~invariant
    prefill = info[is_prefill].copy()
    prefill[:, 4] = 0
    return (
        torch.from_numpy(np.ascontiguousarray(info[~is_prefill])),
        torch.from_numpy(np.ascontiguousarray(table[~is_prefill])),
        torch.from_numpy(prefill),
        torch.from_numpy(np.ascontiguousarray(table[is_prefill])),
    )
