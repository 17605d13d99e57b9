"""How a native batch is split for the kernels (:mod:`kvserve.model.attention_metadata`).

Pure functions of the batch's ``seqs`` rows ``(row_start, num_rows, num_tokens,
cached_seq_len, prior_only)`` and block tables: the split at the invariance reach,
the batch-invariant view, cascade groups of shared prefixes, and the AMX/vector
prefill split. None of them depends on the thread count or on anything but the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvserve.model.attention_types import (
    CASCADE_MIN_SHARED_TOKENS,
    CascadeSplit,
    NativeBatch,
    SeqSpec,
)


def split_at_reach(seqs: Sequence[SeqSpec], reach: int) -> tuple[list[SeqSpec], set[int]]:
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


def invariant_seqs(
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


def cascade_split(
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


def amx_split(
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
