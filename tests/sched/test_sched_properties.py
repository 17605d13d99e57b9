"""Property tests: random workloads under both policies, checked every step.

Invariants: the token budget is never exceeded; at most ``max_num_seqs`` run; every
step schedules something while requests are unfinished; scheduled token ids and
blocks match the requests; the KV cache's own invariants hold; the separated policy
never mixes phases, runs one prefill per step and pads to its buckets; at the end
every request not aborted has exactly ``max_tokens`` outputs and no block is held.

With speculation (``spec_k > 0``) the fake runner proposes random drafts and accepts a
random prefix of each: drafts only ride on decodes, count against the budget, never
pass ``max_tokens``/``max_model_len``; after every update a running request holds
exactly ``cdiv(num_computed_tokens, block_size)`` blocks (rejected drafts' blocks
freed) and its cached blocks cover accepted tokens only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.kv_cache import KVCacheManager, cdiv
from kvserve.request import Request, RequestStatus, SamplingParams
from kvserve.sched import make_scheduler
from kvserve.sched.output import ModelRunnerOutput
from kvserve.sched.step_builder import is_decode

PREFIXES = [list(range(10_000 + 300 * i, 10_000 + 300 * i + 300)) for i in range(2)]


@dataclass
class Spec:
    req_id: str
    arrival: int
    prompt: list[int]
    max_tokens: int
    abort_at: int | None


@st.composite
def scenarios(draw, policy):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 200))
    max_num_batched_tokens = draw(st.integers(1, 96))
    max_num_seqs = draw(st.integers(1, 6))
    last = min(max_num_batched_tokens, max_model_len)
    prefill_buckets = None
    seqs_buckets = None
    if policy == "separated" and draw(st.booleans()):
        prefill_buckets = tuple(
            sorted(set(draw(st.lists(st.integers(1, last), max_size=4))) - {last}) + [last]
        )
        seqs_buckets = tuple(
            sorted(set(draw(st.lists(st.integers(1, max_num_seqs), max_size=3))) - {max_num_seqs})
            + [max_num_seqs]
        )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=draw(st.booleans()))
    config = SchedulerConfig(
        scheduler_policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 17])),
        num_batched_tokens_buckets=prefill_buckets,
        num_seqs_buckets=seqs_buckets,
    )
    specs = []
    for i in range(draw(st.integers(1, 8))):
        prompt_len = draw(st.integers(1, max_model_len - 1))
        max_tokens = draw(st.integers(1, min(12, max_model_len - prompt_len)))
        prefix = draw(st.sampled_from([None, 0, 1]))
        shared = 0 if prefix is None else draw(st.integers(0, prompt_len))
        prompt = (PREFIXES[prefix][:shared] if prefix is not None else []) + [
            100_000 * (i + 1) + t for t in range(prompt_len - shared)
        ]
        abort_at = draw(st.one_of(st.none(), st.none(), st.integers(0, 30)))
        specs.append(Spec(f"r{i}", draw(st.integers(0, 12)), prompt, max_tokens, abort_at))
    # Room for the largest request alone, plus a random amount (small caches preempt).
    worst = max(min(len(s.prompt) + s.max_tokens - 1, max_model_len) for s in specs)
    num_blocks = cdiv(worst, block_size) + 1 + draw(st.integers(0, 3 * cdiv(worst, block_size)))
    return config, cache, num_blocks, specs


def check_run(
    config: SchedulerConfig,
    cache: CacheConfig,
    num_blocks: int,
    specs: list[Spec],
    spec_k: int = 0,
    seed: int = 0,
) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(
        num_blocks,
        cache.block_size,
        config.model_len,
        enable_caching=cache.enable_prefix_caching,
    )
    sched = make_scheduler(config, kv)
    resolved = config.resolved()
    requests = {
        s.req_id: Request(s.req_id, s.prompt, SamplingParams(max_tokens=s.max_tokens))
        for s in specs
    }
    pending = sorted(specs, key=lambda s: s.arrival)
    aborted: set[str] = set()
    step = 0
    while pending or sched.has_unfinished_requests():
        assert step < 5_000, "no finish within 5000 steps"
        while pending and pending[0].arrival <= step:
            sched.add_request(requests[pending.pop(0).req_id])
        for s in specs:
            if s.abort_at == step and s.req_id in sched.requests:
                sched.finish_requests(s.req_id, RequestStatus.FINISHED_ABORTED)
                aborted.add(s.req_id)
        before = {r: requests[r].num_computed_tokens for r in sched.requests}
        kinds = {r: is_decode(requests[r]) for r in sched.requests}
        out = sched.schedule()

        # Budget, sequence slots, progress.
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(sched.running) <= config.max_num_seqs
        if sched.has_unfinished_requests():
            assert not out.is_empty, f"step {step}: nothing scheduled"
        # Every scheduled request: right tokens, enough blocks; queues hold the right blocks.
        for req_id, n in out.num_scheduled_tokens.items():
            request = requests[req_id]
            start = out.cached_seq_len[req_id]
            assert n >= 1 and start == request.num_computed_tokens
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            expected = request.all_token_ids[start : start + n - len(drafts)] + drafts
            assert out.scheduled_token_ids[req_id] == expected
            if drafts:
                assert kinds[req_id] and n == 1 + len(drafts)
                assert drafts == request.spec_token_ids[: len(drafts)]
                assert request.num_output_tokens + len(drafts) < request.max_tokens
                assert start + n <= config.max_model_len
            assert len(kv.get_block_ids(req_id)) >= cdiv(start + n, cache.block_size)
            assert request.status == RequestStatus.RUNNING
            if req_id in {r.req_id for r in out.scheduled_new_reqs}:
                assert start >= 0
            else:
                assert start == before[req_id]
        for request in sched.waiting:
            assert kv.get_block_ids(request.req_id) == []
        assert set(out.scheduled_req_ids) == set(out.num_scheduled_tokens)
        kv.check_invariants()

        if config.scheduler_policy == "separated":
            assert out.phase != "mixed"
            decodes = [r for r in out.num_scheduled_tokens if kinds.get(r, False)]
            prefills = [r for r in out.num_scheduled_tokens if r not in decodes]
            assert not (decodes and prefills)
            assert len(prefills) <= 1
            for r in prefills:
                padded = out.num_scheduled_tokens_padded[r]
                assert padded in resolved.num_batched_tokens_buckets
                assert padded >= out.num_scheduled_tokens[r]
            if decodes:
                assert out.decode_batch_size_padded in resolved.num_seqs_buckets
                assert out.decode_batch_size_padded >= len(decodes)
        else:
            assert out.num_scheduled_tokens_padded == out.num_scheduled_tokens

        sampled = {}
        for r, n in out.num_scheduled_tokens.items():
            drafts = out.scheduled_spec_decode_tokens.get(r, [])
            if out.cached_seq_len[r] + n - len(drafts) == requests[r].num_tokens:
                m = rng.randint(0, len(drafts))  # accepted drafts
                sampled[r] = drafts[:m] + [7]
        proposals = {r: [rng.randint(1, 9) for _ in range(rng.randint(0, spec_k))] for r in sampled}
        sched.update_from_output(
            out, ModelRunnerOutput(sampled_token_ids=sampled, spec_token_ids=proposals)
        )
        bs = cache.block_size
        for request in sched.running:
            blocks = kv.req_to_blocks.get(request.req_id, [])
            if request.req_id in out.scheduled_spec_decode_tokens:
                assert len(blocks) == cdiv(request.num_computed_tokens, bs), request
            for i in range(kv.num_cached_blocks.get(request.req_id, 0)):
                assert (i + 1) * bs <= request.num_computed_tokens
                # uncached when another block already holds the same content
                assert blocks[i].block_hash in (None, request.block_hashes[i])
        kv.check_invariants()
        step += 1

    for s in specs:
        request = requests[s.req_id]
        assert request.is_finished
        if s.req_id not in aborted:
            assert request.num_output_tokens == s.max_tokens, request
            assert request.status == RequestStatus.FINISHED_LENGTH
    assert kv.num_active_blocks == 0
    kv.check_invariants()
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hits: {kv.prefix_cache_hits > 0}")
    if spec_k:
        event(f"drafts verified: {sched.spec_stats.num_drafts > 0}")


@pytest.mark.parametrize("policy", ["mixed", "separated"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_workloads_keep_every_invariant(policy, data):
    config, cache, num_blocks, specs = data.draw(scenarios(policy))
    check_run(config, cache, num_blocks, specs)


@pytest.mark.parametrize("policy", ["mixed", "separated"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_workloads_with_speculation_keep_every_invariant(policy, data):
    config, cache, num_blocks, specs = data.draw(scenarios(policy))
    spec_k = data.draw(st.integers(1, 5))
    check_run(
        config, cache, num_blocks, specs, spec_k=spec_k, seed=data.draw(st.integers(0, 1 << 16))
    )
