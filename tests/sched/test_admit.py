"""kvserve.sched.kv_admission: typed admission results, the in-flight rule and the Admitter;
kvserve.sched.samples.hand_over_lead; kvserve.sched.remote_kv without a connector."""

from __future__ import annotations

import pytest

from kvserve.kv_cache import KVCacheManager
from kvserve.request import Request, RequestStatus, SamplingParams
from kvserve.sched import kv_admission as admit
from kvserve.sched.kv_admission import (
    DEFER_MIN_IN_FLIGHT_TOKENS,
    Admission,
    Admitter,
    Outcome,
    in_flight_blocks,
    in_flight_tokens,
    should_defer,
)
from kvserve.sched.remote_kv import RemoteKV
from kvserve.sched.samples import hand_over_lead

BS = 16


def req(req_id: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens))


def hashed(kv: KVCacheManager, r: Request) -> Request:
    kv.block_hashes(r)
    return r


def test_admission_results_are_typed_and_checked() -> None:
    assert admit.run(5) == Admission(Outcome.RUN, 5)
    assert admit.run(5).changed and not admit.run(5).stops_admission
    assert admit.PARK.changed and admit.PARK.num_tokens == 0
    assert admit.NO_FIT.stops_admission and not admit.NO_FIT.changed
    assert not admit.DEFER.stops_admission and not admit.DEFER.changed
    with pytest.raises(ValueError, match="at least one token"):
        admit.run(0)
    with pytest.raises(ValueError, match="only RUN"):
        Admission(Outcome.PARK, 3)
    with pytest.raises(ValueError, match="negative"):
        Admission(Outcome.RUN, -1)


def test_in_flight_blocks_are_the_running_prompts_uncomputed_full_blocks() -> None:
    kv = KVCacheManager(100, BS, 1024)
    owner = hashed(kv, req("o", list(range(10 * BS + 3))))
    owner.num_computed_tokens = 4 * BS
    in_flight = in_flight_blocks([owner], BS)
    assert in_flight == set(owner.block_hashes[4:10])
    owner.num_computed_tokens = owner.num_prompt_tokens  # prompt done: nothing in flight
    assert in_flight_blocks([owner], BS) == set()


def test_deferral_needs_more_than_the_threshold_in_a_row() -> None:
    kv = KVCacheManager(100, BS, 1024)
    n_blocks = DEFER_MIN_IN_FLIGHT_TOKENS // BS
    owner = hashed(kv, req("o", list(range(2 * n_blocks * BS + 5))))
    follower = hashed(kv, req("f", list(range(2 * n_blocks * BS + 5)) + [9, 9]))
    everything = in_flight_blocks([owner], BS)
    assert in_flight_tokens(follower, 0, everything, BS) == 2 * n_blocks * BS
    assert should_defer(follower, 0, everything, BS)
    # exactly the threshold in flight: computed, not waited for
    exact = set(owner.block_hashes[:n_blocks])
    assert in_flight_tokens(follower, 0, exact, BS) == DEFER_MIN_IN_FLIGHT_TOKENS
    assert not should_defer(follower, 0, exact, BS)
    # past a prefix hit the run is counted from the first missing block
    assert in_flight_tokens(follower, n_blocks, exact, BS) == 0
    assert not should_defer(follower, 0, None, BS)


def test_admitter_runs_or_does_not_fit_without_changing_anything() -> None:
    kv = KVCacheManager(5, BS, 1024)  # 4 usable blocks
    admitter = Admitter(kv, RemoteKV(None, kv), lambda: 42.0, enable_prefix_caching=True)
    small = req("s", list(range(3 * BS)))
    result = admitter.admit(small, 2 * BS, 0, None)
    assert result == admit.run(2 * BS)
    assert small.status == RequestStatus.RUNNING and small.first_scheduled_time == 42.0
    assert kv.num_held_blocks("s") == 2
    big = req("b", list(range(100, 100 + 5 * BS)))
    assert admitter.admit(big, 5 * BS, 0, None) is admit.NO_FIT
    assert big.status == RequestStatus.WAITING and not kv.holds_blocks("b")
    assert admitter.admit(big, 0, 0, None) is admit.NO_FIT  # no budget
    kv.free(small)
    kv.check_invariants()


def test_admitter_budget_may_depend_on_the_prefix_hit() -> None:
    kv = KVCacheManager(100, BS, 1024)
    admitter = Admitter(kv, RemoteKV(None, kv), lambda: 0.0, enable_prefix_caching=True)
    first = req("a", list(range(4 * BS + 1)))
    assert admitter.admit(first, 1000, 0, None) == admit.run(4 * BS + 1)
    first.num_computed_tokens = first.num_tokens
    kv.cache_blocks(first, first.num_tokens)
    seen: list[int] = []
    second = req("b", list(range(4 * BS + 1)))
    result = admitter.admit(second, lambda ctx: seen.append(ctx) or 7, 0, None)
    assert seen == [4 * BS] and result == admit.run(1)  # one token left after the hit
    assert second.num_computed_tokens == 4 * BS == second.num_cached_tokens


def test_remote_kv_without_a_connector_is_inert() -> None:
    kv = KVCacheManager(10, BS, 1024)
    remote = RemoteKV(None, kv)
    r = req("r", list(range(BS)))
    assert remote.num_external_tokens(r, 0) == 0
    assert not remote.keeps_blocks(r)
    polled = remote.poll(True)
    assert polled.resumed == [] and polled.failed == []


def test_hand_over_lead_makes_the_first_sample_lead_the_rest() -> None:
    assert hand_over_lead(req("x", [1])) is None
    leader, s1, s2 = Request("g", [1, 2, 3], SamplingParams(n=3, max_tokens=2)).with_samples()
    assert leader.pending_forks == [s1, s2]
    heir = hand_over_lead(leader)
    assert heir is s1
    assert leader.pending_forks == [] and s1.fork_parent is None
    assert s1.pending_forks == [s2] and s2.fork_parent is s1


def test_failed_requests_are_taken_once_and_separated_caps_running() -> None:
    from kvserve.config import SchedulerConfig
    from kvserve.sched import make_scheduler

    kv = KVCacheManager(1 + 2 * (1024 // BS), BS, 1024)  # two requests at max_model_len
    mixed = make_scheduler(SchedulerConfig(max_num_seqs=8, max_model_len=1024), kv)
    assert mixed.max_running_requests == 8
    sep = make_scheduler(
        SchedulerConfig(max_num_seqs=8, max_model_len=1024, scheduler_policy="separated"), kv
    )
    assert sep.max_running_requests == 2
    r = req("f", [1, 2, 3])
    sep.failed_requests.append((r, "boom"))
    assert sep.take_failed_requests() == [(r, "boom")]
    assert sep.take_failed_requests() == []
