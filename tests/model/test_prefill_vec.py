"""The vector prefill kernel (prefill_vec.cpp: AVX-512 / AVX2, float32 and bfloat16)
against a float64 reference, its routing, and its chunking-independence."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model.test_attention import (
    check_rows,
    native_step,
    random_step,
    seqs_and_merge,
    spy_calls,
)
from model.test_cascade_attention import _shared_prefix_specs, shared_prefix_steps
from support.prefill import prefill_heavy_steps

from kvserve.model.attention import SeqSpec, build_attention_metadata, paged_attention
from kvserve.model.kernels.backend import default_backend
from kvserve.model.kernels.prefill_amx import AMX_ENV_VAR
from kvserve.model.kernels.prefill_vec import PREFILL_VEC_ISAS, VEC_ENV_VAR

_KERNEL = default_backend().prefill_vec
_ISAS = sorted(_KERNEL.isas) if _KERNEL is not None else []
pytestmark = pytest.mark.skipif(not _ISAS, reason="no native build or no AVX2/AVX-512 CPU")
# (isa, dtype) pairs this machine runs; vdpbf16ps is bfloat16 only
_VARIANTS = [
    (isa, dtype)
    for isa in _ISAS
    for dtype in (torch.float32, torch.bfloat16)
    if isa != "avx512bf16" or dtype == torch.bfloat16
]


def prefill_batches() -> st.SearchStrategy[dict]:
    """Prefill-heavy steps: chunks over cached prefixes (partial last blocks and
    segments, several requests per call), beside decodes; the engine's block sizes."""
    return prefill_heavy_steps(
        block_sizes=[8, 16, 32, 64, 128],
        kv_heads=[1, 2, 3],
        group_sizes=[1, 2, 3, 4],
        head_dims=[32, 64, 128],
        max_cached=400,
        max_chunk=90,
        max_decode_context=200,
    )


def _spy(mp: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Record each PrefillVec call as (number of seqs, merge)."""
    assert _KERNEL is not None
    return spy_calls(mp, _KERNEL, seqs_and_merge)


@pytest.mark.parametrize(("isa", "dtype"), _VARIANTS)
@settings(max_examples=12, deadline=None)
@given(case=prefill_batches())
def test_vec_prefill_matches_reference(isa: str, dtype: torch.dtype, case: dict) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(AMX_ENV_VAR, "0")
        mp.setenv(VEC_ENV_VAR, isa)
        calls = _spy(mp)
        specs, q, k, v, kv_cache = random_step(case, dtype)
        d = case["head_dim"]
        out = native_step(q, k, v, kv_cache, specs, case, d**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    check_rows(out, q, kv_cache, specs, case["block_size"], d**-0.5, tol)
    for s in specs:
        if s.num_rows > 1:
            pad = out[s.token_start + s.num_tokens : s.token_start + s.num_rows]
            assert (pad == 0).all(), "padding rows of a prefill are zero"
    num_prefills = sum(1 for s in specs if s.num_rows > 1)
    assert calls == [(num_prefills, False)], "every prefill request in one vector-kernel call"


@pytest.mark.parametrize(("isa", "dtype"), _VARIANTS)
def test_vec_prior_only_rows_and_lse(isa: str, dtype: torch.dtype) -> None:
    """prior_only rows attend to [0, cached) alone; lse is that part's log-sum-exp;
    prior_only with cached 0 gives output 0 and lse -inf."""
    assert _KERNEL is not None
    gen = torch.Generator().manual_seed(3)
    hk, g, d, bs = 2, 3, 64, 16
    kv_cache = torch.randn(2, hk, 12, bs, d, generator=gen).to(dtype)
    q = torch.randn(7, hk * g, d, generator=gen).to(dtype)
    # seq 0: rows 0-3 over 70 cached tokens (prior only); seq 1: rows 4-6, nothing cached
    seqs = torch.tensor([[0, 4, 4, 70, 1], [4, 3, 3, 0, 1]], dtype=torch.int64)
    tables = torch.tensor([[3, 7, 1, 9, 4], [0, 0, 0, 0, 0]], dtype=torch.int64)
    out = torch.full((7, hk * g, d), 5.0).to(dtype)
    lse = torch.zeros(7, hk * g)
    _KERNEL(q, kv_cache, seqs, tables, d**-0.5, out, lse, isa=isa)
    flat = kv_cache.view(2, hk, -1, d).double()
    slots = torch.tensor([tables[0, p // bs] * bs + p % bs for p in range(70)])
    k = flat[0][:, slots].repeat_interleave(g, 0)  # [H, 70, D]
    v = flat[1][:, slots].repeat_interleave(g, 0)
    scores = q[:4].double().transpose(0, 1) @ k.transpose(1, 2) * d**-0.5  # [H, 4, 70]
    ref = (torch.softmax(scores, -1) @ v).transpose(0, 1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:4].double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[:4].double(), torch.logsumexp(scores, -1).T, atol=1e-4, rtol=0)
    assert (out[4:] == 0).all() and (lse[4:] == float("-inf")).all()


@settings(max_examples=10, deadline=None)
@given(case=shared_prefix_steps())
def test_vec_cascade_decode_matches_reference(case: dict) -> None:
    """Shared-prefix decode groups: prefix once on the vector prefill kernel, merged
    exactly into each row's suffix (merge=True with row_map)."""
    specs, num_tokens, kv_cache, num_groups = _shared_prefix_specs(case)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(AMX_ENV_VAR, "0")
        mp.delenv(VEC_ENV_VAR, raising=False)
        calls = _spy(mp)
        gen = torch.Generator().manual_seed(case["seed"] + 1)
        q, k, v = (torch.randn(num_tokens, n, 64, generator=gen).bfloat16() for n in (9, 3, 3))
        out = native_step(q, k, v, kv_cache, specs, case, 0.125)
    check_rows(out, q, kv_cache, specs, case["block_size"], 0.125, 2e-2)
    assert [n for n, merge in calls if merge] == ([num_groups] if num_groups else [])


def test_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AMX (or with it off), prefill chunks of any length go to the vector
    kernel for float32 and bfloat16; KVSERVE_PREFILL_VEC=0 restores the old split
    (short chunks prior-only in the decode kernel, long ones through flash); shapes the
    kernel lacks (head_dim 16) keep the old split; decode-only steps never call it."""
    assert _KERNEL is not None
    monkeypatch.setenv(AMX_ENV_VAR, "0")
    calls = _spy(monkeypatch)
    bs, d = 16, 64

    def step(dtype: torch.dtype, n: int, head_dim: int = d, decode_only: bool = False) -> None:
        specs = (
            [SeqSpec(0, 1, 1, 40, [1, 2, 3])]
            if decode_only
            else [SeqSpec(0, n, n, 40, list(range(1, 2 + (40 + n) // bs)))]
        )
        num_blocks = 3 + (40 + n) // bs
        kv = torch.randn(2, 1, num_blocks, bs, head_dim).to(dtype)
        rows = specs[0].num_rows
        q, k, v = (torch.randn(rows, h, head_dim).to(dtype) for h in (3, 1, 1))
        meta = build_attention_metadata(
            specs,
            num_tokens=rows,
            block_size=bs,
            kv_segment_size=512,
            backend="native",
            kv_dtype=dtype,
        )
        paged_attention(q, k, v, kv, meta, 0.125)

    for dtype in (torch.float32, torch.bfloat16):
        for n in (3, 40):
            calls.clear()
            step(dtype, n)
            assert calls == [(1, False)], (dtype, n)
    calls.clear()
    step(torch.bfloat16, 40, head_dim=16)
    step(torch.bfloat16, 1, decode_only=True)
    assert calls == []
    monkeypatch.setenv(VEC_ENV_VAR, "0")
    step(torch.bfloat16, 40)
    step(torch.float32, 3)
    assert calls == []
    assert not _KERNEL.supports(torch.bfloat16, 64)
    monkeypatch.setenv(VEC_ENV_VAR, "avx512bf16")
    assert not _KERNEL.supports(torch.float32, 64), "vdpbf16ps is bfloat16 only"
    monkeypatch.delenv(VEC_ENV_VAR)
    assert _KERNEL.supports(torch.float32, 128)
    assert not _KERNEL.supports(torch.float32, 80)
    with pytest.raises(RuntimeError, match="returned 2"):  # a variant this call can't use
        q = torch.randn(2, 1, 64)
        _KERNEL(
            q,
            torch.zeros(2, 1, 2, 16, 64),
            torch.tensor([[0, 2, 2, 0, 0]]),
            torch.tensor([[1]]),
            0.1,
            torch.empty_like(q),
            isa="avx512bf16",
        )


def test_isas_match_the_cpu() -> None:
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    assert ("avx512f" in flags) == ("avx512" in _ISAS)
    assert ("avx512_bf16" in flags and "avx512bw" in flags) == ("avx512bf16" in _ISAS)
    assert ("avx2" in flags) == ("avx2" in _ISAS)
    assert set(_ISAS) <= set(PREFILL_VEC_ISAS)


@pytest.mark.parametrize(("isa", "dtype"), _VARIANTS)
def test_row_result_does_not_depend_on_chunking(isa: str, dtype: torch.dtype) -> None:
    """A prompt's rows get bitwise the same attention whether the prompt is one chunk,
    several chunks of any split points, or shares its call with other requests."""
    assert _KERNEL is not None
    rng = random.Random(11)
    hk, g, d, bs, total = 3, 3, 64, 16, 300
    nblk = -(-total // bs)
    num_blocks = 2 * nblk + 2
    blocks = rng.sample(range(1, num_blocks), nblk)
    other = [b for b in range(1, num_blocks) if b not in blocks][:nblk]
    gen = torch.Generator().manual_seed(5)
    kv_cache = torch.randn(2, hk, num_blocks, bs, d, generator=gen).to(dtype)
    q_all = torch.randn(total, hk * g, d, generator=gen).to(dtype)
    flat = kv_cache.view(2, hk, -1, d)

    def kv_rows(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(start, end)])
        return flat[0][:, slots].transpose(0, 1), flat[1][:, slots].transpose(0, 1)

    def run(start: int, end: int, neighbour: bool) -> torch.Tensor:
        """rows [start, end) of the prompt as one chunk (cached = start); optionally
        after another request's chunk and before a decode row in the same step."""
        n = end - start
        specs, qs, ks, vs = [], [], [], []
        row = 0
        if neighbour:  # another prefill over the other blocks (its KV: whatever is there)
            specs.append(SeqSpec(0, 37, 37, 100, other[: -(-137 // bs)]))
            qs.append(torch.randn(37, hk * g, d).to(dtype))
            k_o = flat[0][:, [other[p // bs] * bs + p % bs for p in range(100, 137)]]
            v_o = flat[1][:, [other[p // bs] * bs + p % bs for p in range(100, 137)]]
            ks.append(k_o.transpose(0, 1))
            vs.append(v_o.transpose(0, 1))
            row = 37
        specs.append(SeqSpec(row, n, n, start, blocks))
        qs.append(q_all[start:end])
        k, v = kv_rows(start, end)
        ks.append(k)
        vs.append(v)
        if neighbour:
            specs.append(SeqSpec(row + n, 1, 1, 50, other[:4]))
            qs.append(torch.randn(1, hk * g, d).to(dtype))
            ks.append(flat[0][:, [other[3] * bs + 50 % bs]].transpose(0, 1))
            vs.append(flat[1][:, [other[3] * bs + 50 % bs]].transpose(0, 1))
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        meta = build_attention_metadata(
            specs,
            num_tokens=q.shape[0],
            block_size=bs,
            kv_segment_size=128,
            backend="native",
            kv_dtype=dtype,
        )
        out = paged_attention(q, k, v, kv_cache, meta, d**-0.5)
        return out[row : row + n]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(AMX_ENV_VAR, "0")
        mp.setenv(VEC_ENV_VAR, isa)
        whole = run(0, total, neighbour=False)
        for cuts in ([0, 64, 300], [0, 1 + 16 * 3, 200, 300], [0, 5, 7, 150, 299, 300]):
            for i in range(len(cuts) - 1):
                a, b = cuts[i], cuts[i + 1]
                # a 1-row chunk is a decode row (the decode kernel): only chunks >= 2 rows
                if b - a >= 2:
                    got = run(a, b, neighbour=i % 2 == 1)
                    assert torch.equal(got, whole[a:b]), (cuts, a, b)
