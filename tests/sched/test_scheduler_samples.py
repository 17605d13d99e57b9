"""Samples of one request (n / best_of): the leader computes the prompt once, the
other samples fork from it (full prompt blocks shared, partial block copied), and
every block is accounted for after aborts, with both policies."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.kv_cache import KVCacheManager
from kvserve.request import Request, RequestStatus, SamplingParams
from kvserve.sched import make_scheduler
from kvserve.sched.base import Scheduler
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput

BS = 16


def make(policy: str, num_blocks: int = 200, **config: object) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, BS, 512)
    cfg = SchedulerConfig(max_model_len=512, scheduler_policy=policy, max_num_seqs=8, **config)
    return make_scheduler(cfg, kv), kv


def group(n: int, prompt_len: int = 40, max_tokens: int = 6, req_id: str = "r") -> Request:
    request = Request(
        req_id,
        list(range(1, prompt_len + 1)),
        SamplingParams(n=n, max_tokens=max_tokens, seed=3, temperature=1.0),
    )
    request.with_samples()
    return request


def run_step(sched: Scheduler, forks: bool = True) -> SchedulerOutput:
    """One step with a stand-in runner: token 7 for whoever finishes its tokens, and
    (when ``forks``) a first token for each fork, as the model runner does."""
    so = sched.schedule()
    sampled: dict[str, list[int]] = {}
    for req_id, n in so.num_scheduled_tokens.items():
        r = sched.requests[req_id]
        sampled[req_id] = [7] if so.cached_seq_len[req_id] + n >= r.num_tokens else []
    if forks:
        for samples in so.forks.values():
            for fork in samples:
                sampled[fork.req_id] = [8]
    sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))
    return so


@pytest.mark.parametrize("policy", ["mixed", "separated"])
def test_prompt_computed_once_and_blocks_shared(policy: str) -> None:
    sched, kv = make(policy)
    leader = group(4)
    sched.add_request(leader)
    assert sched.num_waiting == 1 and len(sched.requests) == 4

    so = run_step(sched)
    assert so.num_scheduled_tokens == {"r": 40}  # the prompt, once
    assert [f.req_id for f in so.forks["r"]] == ["r#1", "r#2", "r#3"]
    assert {f.sampling_params.seed for f in so.forks["r"]} | {3} == {
        s.sampling_params.seed for s in leader.group
    }
    assert len({s.sampling_params.seed for s in leader.group}) == 4  # distinct streams
    assert sched.num_running == 4
    # 40 tokens = 2 full blocks (shared by all 4) + 1 partial block (copied 3 times)
    rows = [kv.get_block_ids(s.req_id) for s in leader.group]
    assert all(row[:2] == rows[0][:2] for row in rows)
    assert len({row[2] for row in rows}) == 4
    assert kv.num_active_blocks == 2 + 4
    kv.check_invariants()

    so = run_step(sched)  # the copies reach the runner before the forked samples run
    assert sorted(so.block_copies) == sorted((rows[0][2], row[2]) for row in rows[1:])
    new_ids = {r.req_id for r in so.scheduled_new_reqs}
    assert new_ids == {"r#1", "r#2", "r#3"}  # the runner learns each fork once, with its blocks
    assert all(so.num_scheduled_tokens[s.req_id] == 1 for s in leader.group)
    so = run_step(sched)
    assert not so.block_copies and not so.scheduled_new_reqs

    while sched.has_unfinished_requests():
        run_step(sched)
    assert all(s.num_output_tokens == 6 for s in leader.group)
    assert kv.num_active_blocks == 0
    kv.check_invariants()


@pytest.mark.parametrize("policy", ["mixed", "separated"])
def test_abort_mid_decode_frees_every_sample(policy: str) -> None:
    sched, kv = make(policy)
    leader = group(8, prompt_len=37, max_tokens=50)
    sched.add_request(leader)
    for _ in range(4):
        run_step(sched)
    assert sched.num_running == 8 and kv.num_active_blocks > 0
    sched.finish_requests([s.req_id for s in leader.group], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and not sched.requests
    assert kv.num_active_blocks == 0
    kv.check_invariants()


def test_abort_before_the_fork() -> None:
    sched, kv = make("mixed", max_num_batched_tokens=16)  # a 40-token prompt takes 3 steps
    leader = group(3)
    sched.add_request(leader)
    run_step(sched)
    # aborting a waiting sample only drops it
    sched.finish_requests("r#2", RequestStatus.FINISHED_ABORTED)
    assert [s.req_id for s in leader.pending_forks] == ["r#1"]
    # aborting the leader mid-prompt hands the prompt to the next sample
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    heir = sched.requests["r#1"]
    assert heir in sched.waiting and not heir.pending_forks and heir.fork_parent is None
    assert kv.num_active_blocks == 0
    while sched.has_unfinished_requests():
        run_step(sched)
    assert heir.num_output_tokens == 6
    kv.check_invariants()
    assert kv.num_active_blocks == 0


def test_runner_without_forks_falls_back_to_the_prefix_cache() -> None:
    sched, kv = make("mixed")
    leader = group(3)
    sched.add_request(leader)
    run_step(sched, forks=False)  # no first tokens for the forks
    assert [r.req_id for r in sched.waiting] == ["r#1", "r#2"]
    so = run_step(sched, forks=False)
    # each computes only what the cache does not hold: the partial last block
    assert so.num_scheduled_tokens["r#1"] == so.num_scheduled_tokens["r#2"] == 40 - 32
    while sched.has_unfinished_requests():
        run_step(sched, forks=False)
    assert kv.num_active_blocks == 0
    kv.check_invariants()


def test_no_block_for_the_copy_requeues_the_sample() -> None:
    sched, kv = make("mixed", num_blocks=6)  # 5 usable: prompt 3 + 2 copies at most
    leader = group(4, max_tokens=2)
    sched.add_request(leader)
    run_step(sched)
    assert sched.num_running == 3 and [r.req_id for r in sched.waiting] == ["r#3"]
    assert sched.requests["r#3"].output_token_ids == [8]  # keeps its first token
    while sched.has_unfinished_requests():
        run_step(sched)
    assert all(s.num_output_tokens == 2 for s in leader.group)
    assert kv.num_active_blocks == 0
    kv.check_invariants()


def test_group_larger_than_max_num_seqs_is_refused() -> None:
    sched, kv = make("mixed")
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add_request(group(9))
    assert not sched.requests and kv.num_active_blocks == 0


def test_fork_unit_block_accounting() -> None:
    kv = KVCacheManager(20, BS, 512, enable_caching=False)
    parent = Request("p", list(range(40)), SamplingParams())
    child = Request("c", list(range(40)), SamplingParams())
    kv.allocate_slots(parent, 40)
    copies = kv.fork(parent, child, 40)
    pb, cb = kv.get_block_ids("p"), kv.get_block_ids("c")
    assert cb[:2] == pb[:2] and copies == [(pb[2], cb[2])]
    kv.check_invariants()  # shared uncached blocks are allowed for forks
    kv.free(parent)
    assert kv.num_active_blocks == 3  # the child still holds the shared ones
    kv.free(child)
    assert kv.num_active_blocks == 0
    # a prompt ending on a block boundary needs no copy
    aligned = Request("a", list(range(32)), SamplingParams())
    kv.allocate_slots(aligned, 32)
    assert kv.fork(aligned, Request("a2", list(range(32)), SamplingParams()), 32) == []
    kv.check_invariants()


@pytest.mark.parametrize("policy", ["mixed", "separated"])
def test_running_sequences_never_exceed_max_num_seqs(policy: str) -> None:
    """Issue 21 item 4: several n=4 groups admitted in one step used to count only
    their own leader's samples, so 3 groups of 4 ran 12 sequences under max_num_seqs 8."""
    sched, kv = make(policy, num_blocks=400)
    for i in range(6):
        sched.add_request(group(4, req_id=f"g{i}", max_tokens=4))
    peak = 0
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        run_step(sched)
        peak = max(peak, sched.num_running)
        assert sched.num_running <= 8, [r.req_id for r in sched.running]
    assert peak == 8 and not sched.has_unfinished_requests()
    assert kv.num_active_blocks == 0
    kv.check_invariants()
