"""The plain data of per-step attention metadata (:mod:`kvserve.model.attention_metadata`).

The dataclasses the metadata builder returns and every layer's attention reads, and
the thresholds that choose between the native kernels and PyTorch's flash path.
Plain data only: no behaviour beyond construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.model.kernels.paged_attention import PagedAttention
from kvserve.model.kernels.prefill_amx import PrefillAmx
from kvserve.model.kernels.prefill_vec import PrefillVec


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
