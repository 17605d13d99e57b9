"""Issue 25's target in small (docs/determinism.md): with no flag, requests past the
old 512-token reach (here up to 900 tokens, beside a shared system prompt) give
bitwise-identical greedy tokens + logprobs and seeded samples alone, in mixed batches
and after prefix-cache hits, in bfloat16 and float32; and through a prefill worker +
decode worker (slow: two server processes). The full-size run is
``benchmarks/batch_invariance.py`` / :mod:`kvserve.bench.invariance`."""

from __future__ import annotations

import pytest
import torch

from kvserve.bench.invariance import check_disaggregated, check_invariance, make_prompts
from kvserve.model.invariance import AUTO_INVARIANT_MAX_CONTEXT_VEC
from kvserve.model.kernels.backend import default_backend

_B = default_backend()
_INV = (
    _B.prefill_vec is not None
    and _B.prefill_vec.supports_invariant(torch.bfloat16, 64, 16, 512)
    and (_B.prefill_amx is None or not _B.prefill_amx.available)
    and _B.linear is not None
    and _B.linear.linear_bf16_available
)
pytestmark = pytest.mark.skipif(
    not _INV, reason="needs AVX-512 + AVX512-BF16 without AMX (the long default reach)"
)


def _prompts() -> list[list[int]]:
    return make_prompts(4, 16, 900, seed=11, shared_prefix=64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_mode_past_512_alone_batched_cached(dtype: str) -> None:
    rep = check_invariance(_prompts(), dtype=dtype, max_tokens=3, max_num_seqs=4, seed=2)
    assert not rep.batch_invariant
    assert rep.invariant_max_context == AUTO_INVARIANT_MAX_CONTEXT_VEC
    assert rep.mismatches == []
    for mode in ("batched", "cache_hit"):  # every request is within the reach
        assert rep.counts[mode]["beyond"] == [0, 0]
        assert rep.counts[mode]["guaranteed"] == [4, 4]


@pytest.mark.slow
def test_default_mode_disaggregated_prefill_decode(tmp_path) -> None:
    res = check_disaggregated(
        _prompts(), dtype="bfloat16", max_tokens=3, max_model_len=1024, log_dir=str(tmp_path)
    )
    assert res["remote_tokens"] > 0  # the prompts' KV did come over the wire
    assert res["guaranteed"] == res["compared"] == 4
    assert res["mismatches"] == []
