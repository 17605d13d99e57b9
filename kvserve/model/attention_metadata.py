"""Per-step attention metadata: what every layer's attention reads, built once a step.

Plain per-request specs (:class:`SeqSpec`) come in from the model runner; out comes
:class:`AttentionMetadata` for the native kernel (:class:`NativeBatch`) or the
portable PyTorch path (:class:`PrefillSeq` list + :class:`DecodeBatch`). The layout
and the segmented-prefill rules are described in :mod:`kvserve.model.attention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from kvserve.model.attention_splits import amx_split, cascade_split, invariant_seqs, split_at_reach
from kvserve.model.attention_types import (  # noqa: F401  (re-exported)
    AUTO_INVARIANT_MAX_CONTEXT,
    CASCADE_MIN_SHARED_TOKENS,
    NATIVE_PREFILL_MAX_ROWS,
    NATIVE_WHOLE_MAX_CONTEXT,
    NATIVE_WHOLE_MAX_TOKENS,
    AttentionMetadata,
    CascadeSplit,
    DecodeBatch,
    NativeBatch,
    NativePrefill,
    PrefillSeq,
    SeqSpec,
)
from kvserve.model.kernels.backend import KernelBackend, default_backend
from kvserve.model.kernels.paged_attention import PagedAttention

AttentionBackend = Literal["auto", "native", "portable"]
ResolvedBackend = Literal["native", "portable"]
_NEG_INF = float("-inf")


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
    :func:`invariant_seqs`), so a row's attention is computed the same way whatever
    chunk, batch or prefix grouping it is in (no cascade split, no flash/AMX/vector
    prefill path). Needs the native kernel (else RuntimeError).

    ``invariant_max_context`` (native kernel only; ignored with ``batch_invariant``):
    the same for every position below it: prefill chunks crossing it are split there
    (:func:`split_at_reach`), the part whose context ends within it runs whole in
    the paged kernel and its rows join no cascade group; the rest takes the fast
    route. So requests of at most this many tokens are invariant. 0: none.

    ``kv_8bit``: the cache is 8-bit (:mod:`kvserve.model.kernels.kv8`): every prefill
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
            seqs, split_heads = split_at_reach(seqs, invariant_max_context)
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
            meta.native = invariant_seqs(
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
    amx_seqs = amx_split(info, table, invariant) if prefills else (None, None, None, None)
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
            *amx_seqs,
            cascade=None if kv_8bit else cascade_split(info, table, block_size, invariant),
            prefill_amx=kernels.prefill_amx,
            prefill_vec=kernels.prefill_vec,
        ),
    )
