"""The paged attention kernel's batch invariance, at the kernel level: a query row's
output and log-sum-exp are bitwise the same whether it is a decode row (a one-row
seq), a row of a prefill chunk of any size or start (row tiles, the key-lanes Q.K
form from 8 queries per tile on), or beside other requests, for every segment size.
See csrc/paged_attention.cpp (absolute key parts) and docs/determinism.md."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.kernels.backend import default_backend

_KERNEL = default_backend().attention
pytestmark = pytest.mark.skipif(_KERNEL is None, reason="needs the native kernel")

BS, HK, G, D = 16, 3, 3, 64


def _setup(dtype: torch.dtype, total: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    nblk = -(-total // BS)
    kv = torch.randn(2, HK, nblk + 1, BS, D, generator=gen).to(dtype)
    kv[:, :, 0] = 0  # the null block
    table = torch.randperm(nblk, generator=gen) + 1  # scattered blocks
    q = torch.randn(total, HK * G, D, generator=gen).to(dtype)
    return kv, table.to(torch.int64), q


def _run(kv, table, q_rows, seqs: list[tuple[int, int, int]], seg: int):
    """seqs: (row_start, num_rows, cached) of one request's rows; returns out, lse."""
    info = torch.tensor([(r, n, n, c, 0) for r, n, c in seqs], dtype=torch.int64)
    tables = table.unsqueeze(0).repeat(len(seqs), 1).contiguous()
    lse = torch.full(q_rows.shape[:2], float("-inf"))
    out = _KERNEL(q_rows, kv, info, tables, seg, D**-0.5, lse=lse)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(
    total=st.integers(2, 700),
    start=st.integers(0, 699),
    n=st.integers(1, 80),
    seg=st.sampled_from([0, 32, 64, 100, 512]),
    seed=st.integers(0, 1000),
)
@settings(max_examples=25, deadline=None, derandomize=True)
def test_chunk_rows_equal_decode_rows(dtype, total, start, n, seg, seed) -> None:
    start = min(start, total - 1)
    n = min(n, total - start)
    kv, table, q = _setup(dtype, total, seed)
    rows = q[start : start + n].contiguous()
    # the chunk [start, start + n) as one multi-row seq
    chunk_out, chunk_lse = _run(kv, table, rows, [(0, n, start)], seg)
    # each of its positions as a decode row, all in one batch
    dec_out, dec_lse = _run(kv, table, rows, [(j, 1, start + j) for j in range(n)], seg)
    assert torch.equal(
        chunk_out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        dec_out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )
    assert torch.equal(chunk_lse, dec_lse)
    # the same rows split in two chunks at another point, with a decode row after them
    if n >= 3:
        cut = n // 3
        two_out, two_lse = _run(
            kv,
            table,
            rows,
            [(0, cut, start), (cut, n - cut - 1, start + cut), (n - 1, 1, start + n - 1)],
            seg,
        )
        assert torch.equal(two_out, chunk_out) and torch.equal(two_lse, chunk_lse)
