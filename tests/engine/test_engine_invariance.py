"""Engine-level batch invariance (docs/determinism.md): the same requests alone, in
mixed batches, after a prefix-cache hit and after preemption give bitwise-identical
greedy tokens + logprobs and seeded samples."""

from __future__ import annotations

import pytest

from kvserve.bench.invariance import check_invariance, make_prompts
from kvserve.model.kernels.backend import default_backend

_K = default_backend().linear


@pytest.mark.slow
@pytest.mark.skipif(_K is None or not _K.linear_bf16_available, reason="needs AVX512-BF16")
def test_engine_alone_batched_cached_preempted_bfloat16() -> None:
    prompts = make_prompts(6, 16, 200, seed=3, shared_prefix=48)
    rep = check_invariance(
        prompts,
        dtype="bfloat16",
        max_tokens=6,
        max_num_seqs=4,
        preempt_blocks=20,
        batch_invariant=True,
    )
    assert rep.batch_invariant  # opt-in (docs/determinism.md)
    assert rep.mismatches == []


@pytest.mark.slow
@pytest.mark.skipif(_K is None or not _K.linear_bf16_available, reason="needs AVX512-BF16")
def test_engine_default_mode_short_requests() -> None:
    """No flag, the default Q4_1 weights: requests within the automatic reach are
    invariant alone vs batched vs cache hits, beside a request past the reach that
    shares their system prompt (it computes the shared blocks in some batches)."""
    prompts = make_prompts(5, 16, 300, seed=5, shared_prefix=48)
    prompts.append(prompts[1][:48] + make_prompts(1, 1100, 1100, seed=6)[0])
    rep = check_invariance(prompts, max_tokens=5, max_num_seqs=6)
    assert not rep.batch_invariant and rep.invariant_max_context >= 512
    # the long request is within the reach where the invariant prefill kernel runs
    # (AUTO_INVARIANT_MAX_CONTEXT_VEC), past it elsewhere (512)
    n = sum(len(p) + 5 <= rep.invariant_max_context for p in prompts)
    assert n >= 5
    assert rep.counts["batched"]["guaranteed"] == [n, n]
    assert rep.counts["cache_hit"]["guaranteed"] == [n, n]
    assert rep.mismatches == []
