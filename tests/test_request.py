"""kvserve.request: SamplingParams validation and per-sample params,
Request token bookkeeping and splitting into samples."""

from __future__ import annotations

import pytest

from kvserve.request import (
    FinishReason,
    Request,
    RequestError,
    RequestStatus,
    SamplingParams,
    sample_seed,
)


def test_sampling_params_refuse_bad_values_on_construction() -> None:
    with pytest.raises(RequestError) as e:
        SamplingParams(temperature=-1.0)
    assert e.value.param == "temperature"
    with pytest.raises(RequestError) as e:
        SamplingParams(n=3, best_of=2)
    assert e.value.param in ("n", "best_of")


def test_for_sample_gives_each_sample_its_own_seed_and_one_sequence() -> None:
    params = SamplingParams(n=2, best_of=3, seed=7, prompt_logprobs=1)
    assert params.num_samples == 3
    samples = [params.for_sample(i) for i in range(3)]
    assert [s.seed for s in samples] == [7, sample_seed(7, 1), sample_seed(7, 2)]
    assert len({s.seed for s in samples}) == 3
    assert all(s.n == 1 and s.best_of is None for s in samples)
    assert samples[0].prompt_logprobs == 1 and samples[1].prompt_logprobs is None
    assert all(s.logprobs == 0 for s in samples)  # best_of ranks by logprob
    assert SamplingParams(seed=None).for_sample(1).seed is None


def test_request_tokens_and_finish_reason() -> None:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (3, 3, 0)
    r.append_output_token_ids(9)
    r.append_output_token_ids([8, 7])
    assert r.all_token_ids == [1, 2, 3, 9, 8, 7] and r.output_token_ids == [9, 8, 7]
    assert r.finish_reason is None and not r.is_finished
    r.status = RequestStatus.FINISHED_LENGTH
    assert r.is_finished and r.finish_reason == FinishReason.LENGTH
    assert Request("u", [1], SamplingParams(max_tokens=None)).max_tokens == 1 << 30


def test_drafts_count_only_in_decode() -> None:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=8))
    r.spec_token_ids = [4, 5]
    assert r.num_tokens_with_spec == 3  # prompt not computed yet
    r.append_output_token_ids(6)
    r.num_computed_tokens = 3
    assert r.num_tokens_with_spec == 6


def test_with_samples_splits_into_a_leader_and_pending_forks() -> None:
    r = Request("g", [1, 2], SamplingParams(n=3, seed=1, max_tokens=4), eos_token_id=0)
    group = r.with_samples()
    assert [s.req_id for s in group] == ["g", "g#1", "g#2"]
    assert group[0] is r and r.pending_forks == group[1:]
    assert all(s.fork_parent is r and s.eos_token_id == 0 for s in group[1:])
    assert all(s.sampling_params.n == 1 for s in group)
    single = Request("s", [1], SamplingParams())
    assert single.with_samples() == [single]
