"""The AMX prefill kernel (bfloat16, head_dim 64) against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model.test_attention import check_rows, native_step, random_step, seqs_and_merge, spy_calls
from model.test_cascade_attention import _shared_prefix_specs, shared_prefix_steps
from support.prefill import prefill_heavy_steps

from kvserve.model.kernels.backend import default_backend
from kvserve.model.kernels.prefill_amx import AMX_ENV_VAR

_KERNEL = default_backend().prefill_amx
pytestmark = pytest.mark.skipif(
    _KERNEL is None or not _KERNEL.available, reason="this CPU or build has no AMX-BF16"
)


def amx_batches() -> st.SearchStrategy[dict]:
    """Prefill-heavy steps: long chunks over long cached prefixes, beside decodes."""
    return prefill_heavy_steps(
        block_sizes=[16, 32, 64],
        kv_heads=[1, 3],
        group_sizes=[1, 3],
        head_dims=[64],
        max_cached=700,
        max_chunk=150,
        max_decode_context=300,
    )


def _run(case: dict, monkeypatch: pytest.MonkeyPatch, amx: bool) -> tuple[torch.Tensor, list, int]:
    assert _KERNEL is not None
    monkeypatch.setenv(AMX_ENV_VAR, "1" if amx else "0")
    calls = spy_calls(monkeypatch, _KERNEL, lambda *args, **kwargs: args[2].shape[0])
    specs, q, k, v, kv_cache = random_step(case, torch.bfloat16)
    d = case["head_dim"]
    out = native_step(q, k, v, kv_cache, specs, case, d**-0.5)
    check_rows(out, q, kv_cache, specs, case["block_size"], d**-0.5, 2e-2)
    for s in specs:
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
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(AMX_ENV_VAR, "1")
        calls = spy_calls(mp, _KERNEL, seqs_and_merge)
        gen = torch.Generator().manual_seed(case["seed"] + 1)
        q, k, v = (torch.randn(num_tokens, n, 64, generator=gen).bfloat16() for n in (9, 3, 3))
        out = native_step(q, k, v, kv_cache, specs, case, 0.125)
    check_rows(out, q, kv_cache, specs, case["block_size"], 0.125, 2e-2)
    merges = [n for n, merge in calls if merge]
    assert merges == ([num_groups] if num_groups else [])
