"""The invariant prefill kernel (``kvs_prefill_attention_inv``, csrc/prefill_vec.cpp)
against the paged kernel, bit for bit: any chunk of rows (any start, size, grouping of
requests, prior_only) gives each row exactly the output and lse the
paged kernel gives the same position as a decode row, for every segment size, in
float32 and bfloat16 (both products: FMAs and vdpbf16ps where the CPU has it)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.kernels.backend import default_backend

_B = default_backend()
_PAGED, _VEC = _B.attention, _B.prefill_vec
BS, HK, G, D = 16, 3, 3, 64
pytestmark = pytest.mark.skipif(
    _PAGED is None or _VEC is None or not _VEC.supports_invariant(torch.float32, D, BS, 512),
    reason="needs the native kernels on an AVX-512 CPU",
)


def _setup(dtype: torch.dtype, total: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    nblk = -(-total // BS)
    kv = torch.randn(2, HK, nblk + 1, BS, D, generator=gen).to(dtype)
    kv[:, :, 0] = 0
    table = (torch.randperm(nblk, generator=gen) + 1).to(torch.int64)
    q = (2 * torch.randn(total, HK * G, D, generator=gen)).to(dtype)
    return kv, table, q


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _inv(kv, table, rows, seqs, seg, prior_only=0, lse=None, out=None, merge=False):
    info = torch.tensor([(r, n, n, c, prior_only) for r, n, c in seqs], dtype=torch.int64)
    tables = table.unsqueeze(0).repeat(len(seqs), 1).contiguous()
    lse = torch.full(rows.shape[:2], float("-inf")) if lse is None else lse
    out = torch.empty_like(rows) if out is None else out
    _VEC.invariant(rows, kv, info, tables, seg, D**-0.5, out, lse=lse, merge=merge)
    return out, lse


def _paged(kv, table, rows, seqs, seg, prior_only=0, lse=None, out=None, merge=False):
    info = torch.tensor([(r, n, n, c, prior_only) for r, n, c in seqs], dtype=torch.int64)
    tables = table.unsqueeze(0).repeat(len(seqs), 1).contiguous()
    lse = torch.full(rows.shape[:2], float("-inf")) if lse is None else lse
    if merge:
        _PAGED(rows, kv, info, tables, seg, D**-0.5, lse=lse, out=out)
        return out, lse
    return _PAGED(rows, kv, info, tables, seg, D**-0.5, lse=lse), lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(
    total=st.integers(2, 1300),
    start=st.integers(0, 1299),
    n=st.integers(1, 70),
    seg=st.sampled_from([0, 512, 1024]),
    seed=st.integers(0, 1000),
)
@settings(max_examples=12, deadline=None, derandomize=True)
def test_prefill_rows_equal_paged_decode_rows(dtype, total, start, n, seg, seed) -> None:
    # bfloat16 products are chosen once per process in both kernels (vdpbf16ps on AMD
    # CPUs); run this file with KVSERVE_BF16_DOT=fma for the widened-FMA form
    start = min(start, total - 1)
    n = min(n, total - start)
    kv, table, q = _setup(dtype, total, seed)
    rows = q[start : start + n].contiguous()
    got, got_lse = _inv(kv, table, rows, [(0, n, start)], seg)
    want, want_lse = _paged(kv, table, rows, [(j, 1, start + j) for j in range(n)], seg)
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(got_lse, want_lse)
    if n >= 3:  # other chunkings and groupings in the same call
        cut = n // 3
        two, two_lse = _inv(kv, table, rows, [(0, cut, start), (cut, n - cut, start + cut)], seg)
        assert torch.equal(_bits(two), _bits(got)) and torch.equal(two_lse, got_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(total=st.integers(40, 1100), n=st.integers(2, 40), seed=st.integers(0, 100))
@settings(max_examples=8, deadline=None, derandomize=True)
def test_prior_only_equal_paged(dtype, total, n, seed) -> None:
    """prior_only rows (the prior context alone) as the paged kernel computes them."""
    n = min(n, total - 1)
    kv, table, q = _setup(dtype, total, seed)
    start = total - n
    rows = q[start:].contiguous()
    got, got_lse = _inv(kv, table, rows, [(0, n, start)], 512, prior_only=1)
    want, want_lse = _paged(kv, table, rows, [(0, n, start)], 512, prior_only=1)
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seg", [0, 512])
def test_wholly_visible_parts_equal_paged(dtype, seg) -> None:
    """Rows past a long prior context: parts every lane of a tile sees whole (the
    kernel's unmasked form) and the masked last part, against the paged kernel."""
    total, start, n = 1200, 1100, 96
    kv, table, q = _setup(dtype, total, 7)
    rows = q[start : start + n].contiguous()
    got, got_lse = _inv(kv, table, rows, [(0, n, start)], seg)
    want, want_lse = _paged(kv, table, rows, [(j, 1, start + j) for j in range(n)], seg)
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(got_lse, want_lse)
