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
