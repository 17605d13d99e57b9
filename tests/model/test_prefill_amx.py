"""The AMX prefill kernel (bfloat16, head_dim 64) against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model.test_attention import _make_step, reference_attention
from model.test_cascade_attention import _shared_prefix_specs, shared_prefix_steps

from kvserve.model.attention import build_attention_metadata, paged_attention
from kvserve.model.kernels.backend import default_backend
from kvserve.model.kernels.prefill_amx import AMX_ENV_VAR

_KERNEL = default_backend().prefill_amx
pytestmark = pytest.mark.skipif(
    _KERNEL is None or not _KERNEL.available, reason="this CPU or build has no AMX-BF16"
)


@st.composite
def amx_batches(draw: st.DrawFn) -> dict:
    """Prefill-heavy steps: long chunks over long cached prefixes, beside decodes."""
    num_kv_heads = draw(st.sampled_from([1, 3]))
    return dict(
        block_size=draw(st.sampled_from([16, 32, 64])),
        kv_segment_size=draw(st.sampled_from([0, 64, 512])),
        num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * draw(st.sampled_from([1, 3])),
        head_dim=64,
        prefills=draw(
            st.lists(
                st.tuples(st.integers(0, 700), st.integers(1, 150), st.integers(0, 5)),
                min_size=1,
                max_size=3,
            )
        ),
        decodes=draw(st.lists(st.integers(0, 300), max_size=3)),
        num_dummy=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _run(case: dict, monkeypatch: pytest.MonkeyPatch, amx: bool) -> tuple[torch.Tensor, list, int]:
    assert _KERNEL is not None
    monkeypatch.setenv(AMX_ENV_VAR, "1" if amx else "0")
    calls = []
    original = type(_KERNEL).__call__

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[2].shape[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(_KERNEL), "__call__", spy)
    specs, num_tokens, kv_cache = _make_step(case)
    kv_cache = kv_cache.bfloat16()
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    h, hk, d = case["num_heads"], case["num_kv_heads"], case["head_dim"]
    q, k, v = (torch.randn(num_tokens, n, d, generator=gen).bfloat16() for n in (h, hk, hk))
    meta = build_attention_metadata(
        specs,
        num_tokens=num_tokens,
        num_dummy_decode_rows=case["num_dummy"],
        block_size=case["block_size"],
        kv_segment_size=case["kv_segment_size"],
        backend="native",
        kv_dtype=torch.bfloat16,
    )
    out = paged_attention(q, k, v, kv_cache, meta, d**-0.5)
    for s in specs:
        ref = reference_attention(q.float(), kv_cache.float(), s, case["block_size"], d**-0.5)
        got = out[s.token_start : s.token_start + s.num_tokens].float()
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
        pad = out[s.token_start + s.num_tokens : s.token_start + s.num_rows]
        if amx and s.num_rows > 1:
            assert (pad == 0).all(), "AMX padding rows are zero"
    return out, calls, len([s for s in specs if s.num_rows > 1])


@settings(max_examples=20, deadline=None)
@given(case=amx_batches())
def test_amx_prefill_matches_reference(case: dict) -> None:
    with pytest.MonkeyPatch.context() as mp:
        _, calls, num_prefills = _run(case, mp, amx=True)
    assert calls == [num_prefills], "every prefill request went through one AMX call"


@settings(max_examples=5, deadline=None)
@given(case=amx_batches())
def test_amx_off_uses_the_vector_kernel(case: dict) -> None:
    with pytest.MonkeyPatch.context() as mp:
        _, calls, _ = _run(case, mp, amx=False)
    assert calls == []


def test_amx_needs_bf16_head_dim_64_and_16_aligned_blocks() -> None:
    assert _KERNEL is not None
    assert _KERNEL.supports(torch.bfloat16, 64, 16)
    assert not _KERNEL.supports(torch.float32, 64, 16)
    assert not _KERNEL.supports(torch.bfloat16, 128, 16)
    assert not _KERNEL.supports(torch.bfloat16, 64, 8)


@settings(max_examples=25, deadline=None)
@given(case=shared_prefix_steps())
def test_cascade_decode_matches_reference(case: dict) -> None:
    """Shared-prefix decode groups: prefix once on AMX, merged with each row's suffix."""
    assert _KERNEL is not None
    specs, num_tokens, kv_cache, num_groups = _shared_prefix_specs(case)
    calls: list[tuple[int, bool]] = []
    original = type(_KERNEL).__call__

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((args[2].shape[0], bool(kwargs.get("merge"))))
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(AMX_ENV_VAR, "1")
        mp.setattr(type(_KERNEL), "__call__", spy)
        gen = torch.Generator().manual_seed(case["seed"] + 1)
        q, k, v = (torch.randn(num_tokens, n, 64, generator=gen).bfloat16() for n in (9, 3, 3))
        meta = build_attention_metadata(
            specs,
            num_tokens=num_tokens,
            num_dummy_decode_rows=case["num_dummy"],
            block_size=case["block_size"],
            kv_segment_size=case["kv_segment_size"],
            backend="native",
            kv_dtype=torch.bfloat16,
        )
        out = paged_attention(q, k, v, kv_cache, meta, 0.125)
    for s in specs:
        ref = reference_attention(q.float(), kv_cache.float(), s, case["block_size"], 0.125)
        got = out[s.token_start : s.token_start + s.num_tokens].float()
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    merges = [n for n, merge in calls if merge]
    assert merges == ([num_groups] if num_groups else [])
