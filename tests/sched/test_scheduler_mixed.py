"""Mixed policy: one token budget, decode first, chunked prefill, prefix hits,
preemption by recompute; plus the shared base (stop checks, aborts, refusals)."""

from __future__ import annotations

import json

import pytest

from kvserve.config import SchedulerConfig
from kvserve.kv_cache import KVCacheManager
from kvserve.request import Request, RequestStatus, SamplingParams
from kvserve.sched import MixedScheduler, SchedulerState, make_scheduler
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.sim.cli import main as simulate_main

# ---------------------------------------------------------------- helpers


def simulate(tmp_path, workload, *flags):
    path = tmp_path / "workload.json"
    path.write_text(json.dumps({"requests": workload}))
    out = tmp_path / "out.json"
    assert simulate_main([str(path), *flags, "--output", str(out)]) == 0
    return json.loads(out.read_text())


def chunks(result, req_id):
    """(actual, num_computed before) for every step that scheduled ``req_id``."""
    return [
        (s["num_scheduled_tokens"][req_id], s["num_computed_tokens"][req_id])
        for s in result["steps"]
        if req_id in s["num_scheduled_tokens"]
    ]


def make(num_blocks=1000, block_size=16, max_model_len=2048, enable_prefix_caching=True, **config):
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching=enable_prefix_caching)
    cfg = SchedulerConfig(max_model_len=max_model_len, **config)
    return make_scheduler(cfg, kv), kv


_next_token = [1000]


def req(req_id, prompt_len, max_tokens=4, eos=None, **params):
    tokens = list(range(_next_token[0], _next_token[0] + prompt_len))
    _next_token[0] += prompt_len
    return Request(
        req_id, tokens, SamplingParams(max_tokens=max_tokens, **params), eos_token_id=eos
    )


def run_step(sched, token=7, tokens=None):
    """schedule + a stand-in runner that samples ``token`` (or ``tokens[req_id]``)."""
    out = sched.schedule()
    sampled = {}
    for req_id, n in out.num_scheduled_tokens.items():
        if out.cached_seq_len[req_id] + n == sched.requests[req_id].num_tokens:
            sampled[req_id] = [tokens.get(req_id, token) if tokens else token]
    core = sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out, core


# ---------------------------------------------------------------- budget traces


def test_four_decodes_then_2048_prompt_budget_512_gives_508x4_then_16(tmp_path):
    workload = [{"id": f"d{i}", "prompt_len": 16, "max_tokens": 10} for i in range(4)]
    workload.append({"id": "A", "arrival_step": 1, "prompt_len": 2048, "max_tokens": 16})
    result = simulate(tmp_path, workload, "--max-num-batched-tokens", "512")
    assert chunks(result, "A")[:5] == [(508, 0), (508, 508), (508, 1016), (508, 1524), (16, 2032)]
    for s in result["steps"][1:6]:
        assert s["phase"] == "mixed"
        assert sum(s["num_scheduled_tokens"].values()) == (512 if s["step"] < 5 else 20)
        assert all(s["num_scheduled_tokens"][f"d{i}"] == 1 for i in range(4))
    a = result["requests"]["A"]
    assert (a["first_scheduled_step"], a["first_token_step"]) == (1, 5)
    assert a["num_output_tokens"] == 16
    assert a["finish_step"] == a["first_token_step"] + 15


def test_300_decodes_then_3500_prompt_budget_1024_gives_724x4_then_604(tmp_path):
    workload = [{"id": f"d{i}", "prompt_len": 1, "max_tokens": 20} for i in range(300)]
    workload.append({"id": "P", "arrival_step": 1, "prompt_len": 3500, "max_tokens": 2})
    result = simulate(
        tmp_path, workload, "--max-num-batched-tokens", "1024", "--max-num-seqs", "512"
    )
    assert [n for n, _ in chunks(result, "P")][:5] == [724, 724, 724, 724, 604]
    assert [c for _, c in chunks(result, "P")][:5] == [0, 724, 1448, 2172, 2896]
    assert all(sum(s["num_scheduled_tokens"].values()) <= 1024 for s in result["steps"])


def test_decodes_filling_the_budget_defer_the_prompt_until_they_finish(tmp_path):
    # Budget 8, eight decodes: the prompt gets 0 tokens, is never dropped, and runs
    # once the decodes finish.
    workload = [{"id": f"d{i}", "prompt_len": 1, "max_tokens": 6} for i in range(8)]
    workload.append({"id": "P", "arrival_step": 1, "prompt_len": 20, "max_tokens": 3})
    result = simulate(tmp_path, workload, "--max-num-batched-tokens", "8", "--max-num-seqs", "16")
    steps = result["steps"]
    for s in steps[1:6]:
        assert s["num_scheduled_tokens"] == {f"d{i}": 1 for i in range(8)}
        assert s["num_waiting"] == 1
    assert all(result["requests"][f"d{i}"]["finish_step"] == 5 for i in range(8))
    assert chunks(result, "P") == [(8, 0), (8, 8), (4, 16), (1, 20), (1, 21)]
    assert result["requests"]["P"]["first_scheduled_step"] == 6
    assert result["requests"]["P"]["num_output_tokens"] == 3


def test_10000_token_prompt_without_prefix_cache_budget_2048(tmp_path):
    result = simulate(
        tmp_path,
        [{"id": "L", "prompt_len": 10000, "max_tokens": 4}],
        "--max-num-batched-tokens", "2048", "--max-model-len", "16384",
        "--no-enable-prefix-caching",
    )  # fmt: skip
    assert chunks(result, "L")[:5] == [
        (2048, 0), (2048, 2048), (2048, 4096), (2048, 6144), (1808, 8192),
    ]  # fmt: skip
    assert [s["phase"] for s in result["steps"][:5]] == ["prefill"] * 5
    assert result["requests"]["L"]["first_token_step"] == 4
    assert result["config"]["enable_prefix_caching"] is False


def test_4096_cached_prefix_leaves_three_chunks_of_a_10240_prompt(tmp_path):
    prefix = {"id": "sys", "len": 4096}
    workload = [
        {"id": "S", "prompt_len": 4096, "max_tokens": 1, "shared_prefix": prefix},
        {
            "id": "L",
            "arrival_step": 2,
            "prompt_len": 10240,
            "max_tokens": 4,
            "shared_prefix": prefix,
        },
    ]
    result = simulate(
        tmp_path, workload,
        "--max-num-batched-tokens", "2048", "--max-model-len", "16384", "--block-size", "128",
    )  # fmt: skip
    assert chunks(result, "L")[:3] == [(2048, 4096), (2048, 6144), (2048, 8192)]
    assert chunks(result, "L")[3] == (1, 10240)  # decode right after: 3 prefill steps
    assert result["requests"]["L"]["num_cached_tokens"] == 4096
    assert result["requests"]["S"]["num_cached_tokens"] == 0
    assert result["summary"]["prefix_cache_hit_rate"] == pytest.approx(
        4096 / (4096 + 10240), abs=1e-4
    )


# ---------------------------------------------------------------- direct driving


def test_scheduled_token_ids_and_request_data_follow_the_contract():
    sched, kv = make(max_num_batched_tokens=10)
    a = req("a", 25, max_tokens=2)
    sched.add_request(a)
    out = sched.schedule()
    assert out.phase == "prefill"
    [new] = out.scheduled_new_reqs
    assert new.req_id == "a" and new.prompt_token_ids == a.prompt_token_ids
    assert new.output_token_ids == [] and new.num_computed_tokens == 0
    assert new.block_ids == kv.get_block_ids("a") and len(new.block_ids) == 1
    assert out.scheduled_token_ids["a"] == a.prompt_token_ids[:10]
    assert out.cached_seq_len == {"a": 0}
    assert out.decode_batch_size_padded is None
    assert not hasattr(out, "kv_segment_size")  # the runner's attention setting, not sent
    assert sched.update_from_output(out, ModelRunnerOutput({})) == []  # mid-prefill
    out = sched.schedule()
    assert out.scheduled_new_reqs == []
    assert out.scheduled_cached_reqs.req_ids == ["a"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [10]
    assert out.scheduled_cached_reqs.new_block_ids == [[kv.get_block_ids("a")[1]]]
    assert out.scheduled_token_ids["a"] == a.prompt_token_ids[10:20]
    sched.update_from_output(out, ModelRunnerOutput({}))
    out, core = run_step(sched, token=42)
    assert out.num_scheduled_tokens == {"a": 5}
    assert [(c.req_id, c.new_token_ids, c.finish_reason) for c in core] == [("a", [42], None)]
    out, core = run_step(sched, token=43)
    assert out.phase == "decode" and out.scheduled_token_ids == {"a": [42]}
    assert core[0].finish_reason == "length" and a.output_token_ids == [42, 43]
    assert kv.num_active_blocks == 0 and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"a"}


def test_prefix_hit_starts_num_computed_at_the_hit_length():
    sched, kv = make(max_num_batched_tokens=100)
    a = req("a", 40, max_tokens=1)
    sched.add_request(a)
    run_step(sched)
    b = Request("b", a.prompt_token_ids[:32] + [5, 6, 7], SamplingParams(max_tokens=1))
    sched.add_request(b)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"b": 3}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32
    assert out.cached_seq_len == {"b": 32}
    assert b.num_cached_tokens == 32


def test_preemption_by_recompute_requeues_at_the_front_and_resumes_as_new():
    # 12 usable blocks of 4 tokens; three requests that each grow to 19 tokens (5 blocks).
    sched, kv = make(num_blocks=13, block_size=4, max_model_len=64, max_num_batched_tokens=64)
    reqs = [req(f"r{i}", 8, max_tokens=12) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    preempted_steps = []
    resumed = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        before = sched.num_preemptions
        out, _ = run_step(sched)
        assert len(sched.running) <= sched.max_num_seqs
        kv.check_invariants()
        if sched.num_preemptions > before:
            preempted_steps.append(out)
            # The victim went back to the FRONT of the waiting queue.
            assert sched.waiting[0].req_id in out.finished_req_ids
        for new in out.scheduled_new_reqs:
            if new.output_token_ids:
                resumed.append(new)
    assert sched.num_preemptions >= 1 and preempted_steps
    victim = next(iter(preempted_steps[0].finished_req_ids))
    assert victim == "r2"  # the youngest running request
    assert victim not in preempted_steps[0].num_scheduled_tokens
    assert resumed, "a preempted request comes back in scheduled_new_reqs"
    back = resumed[0]
    r = next(x for x in reqs if x.req_id == back.req_id)
    assert back.prompt_token_ids == r.prompt_token_ids
    assert back.output_token_ids == r.output_token_ids[: len(back.output_token_ids)]
    assert all(
        x.num_output_tokens == 12 and x.status == RequestStatus.FINISHED_LENGTH for x in reqs
    )
    assert sum(x.num_preemptions for x in reqs) == sched.num_preemptions
    assert kv.num_active_blocks == 0


def test_max_num_seqs_limits_running_requests():
    sched, _ = make(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add_request(req(f"r{i}", 5, max_tokens=3))
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert (sched.num_running, sched.num_waiting) == (2, 2)


def test_long_prefill_token_threshold_caps_chunks_only_when_requests_compete():
    sched, _ = make(max_num_batched_tokens=512, long_prefill_token_threshold=100)
    sched.add_request(req("solo", 300, max_tokens=1))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"solo": 300}
    sched.add_request(req("a", 300, max_tokens=1))
    sched.add_request(req("b", 300, max_tokens=1))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 100, "b": 100}


def test_state_is_idle_or_active():
    sched, _ = make()
    assert sched.state == SchedulerState.IDLE
    sched.add_request(req("a", 3, max_tokens=2))
    run_step(sched)
    assert sched.state == SchedulerState.ACTIVE and str(sched.state) == "ACTIVE"
    run_step(sched)
    assert sched.state == SchedulerState.IDLE


# ---------------------------------------------------------------- stop checks


def finish_of(sched, r, tokens, max_steps=20):
    sched.add_request(r)
    it = iter(tokens)
    for _ in range(max_steps):
        if r.is_finished:
            break
        run_step(sched, tokens={r.req_id: next(it)})
    return r


def test_eos_stops_and_frees_blocks():
    sched, kv = make()
    r = finish_of(sched, req("a", 5, max_tokens=10, eos=2), [9, 9, 2, 9])
    assert r.output_token_ids == [9, 9, 2]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert r.finished_time is not None and r.first_token_time is not None
    assert kv.num_active_blocks == 0 and "a" not in sched.requests


def test_ignore_eos_runs_to_max_tokens():
    sched, _ = make()
    r = finish_of(sched, req("a", 5, max_tokens=4, eos=2, ignore_eos=True), [2, 2, 2, 2, 2])
    assert r.output_token_ids == [2, 2, 2, 2] and r.finish_reason == "length"


def test_min_tokens_delays_eos_and_stop_token_ids():
    sched, _ = make()
    r = finish_of(sched, req("a", 5, max_tokens=10, eos=2, min_tokens=3), [2, 5, 2, 9])
    assert r.output_token_ids == [2, 5, 2] and r.finish_reason == "stop"
    r = finish_of(sched, req("b", 5, max_tokens=10, min_tokens=2, stop_token_ids=[5]), [5, 5, 9])
    assert r.output_token_ids == [5, 5] and r.stop_reason == 5 and r.finish_reason == "stop"


def test_max_model_len_finishes_with_length():
    sched, _ = make(max_model_len=8)
    r = finish_of(sched, req("a", 6, max_tokens=100), [1, 1, 1, 1])
    assert r.num_tokens == 8 and r.num_output_tokens == 2 and r.finish_reason == "length"


def test_engine_core_output_fields():
    sched, _ = make()
    sched.add_request(req("a", 3, max_tokens=1))
    out, core = run_step(sched, token=11)
    [c] = core
    assert (c.req_id, c.new_token_ids, c.finish_reason, c.stop_reason, c.num_cached_tokens) == (
        "a", [11], "length", None, 0,
    )  # fmt: skip


# ---------------------------------------------------------------- aborts and refusals


def test_finish_requests_frees_at_once_and_reports_ids_next_step():
    sched, kv = make(max_num_seqs=1)
    a, b = req("a", 20, max_tokens=5), req("b", 20, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    assert kv.num_active_blocks > 0
    sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)
    assert kv.num_active_blocks == 0
    assert a.finish_reason == "abort" and b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and sched.state == SchedulerState.IDLE
    assert sched.schedule().finished_req_ids == {"a", "b"}
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # already gone: ignored
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_skipped():
    sched, kv = make()
    sched.add_request(req("a", 5))
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, ModelRunnerOutput({"a": [1]})) == []
    assert kv.num_active_blocks == 0


def test_repeated_update_and_missing_token_raise():
    sched, _ = make()
    sched.add_request(req("a", 5))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput({"a": [1]}))
    with pytest.raises(RuntimeError, match="exactly once"):
        sched.update_from_output(out, ModelRunnerOutput({"a": [1]}))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="no sampled token"):
        sched.update_from_output(out, ModelRunnerOutput({}))


def test_add_request_refusals_change_nothing():
    sched, _ = make(num_blocks=5, block_size=16, max_model_len=128)
    sched.add_request(req("a", 10))
    with pytest.raises(ValueError, match="already queued"):
        sched.add_request(req("a", 10))
    with pytest.raises(ValueError, match="prompt has 129 tokens but max_model_len is 128"):
        sched.add_request(req("long", 129))
    with pytest.raises(ValueError, match="only 4 usable blocks.*num_kv_blocks=8"):
        sched.add_request(req("big", 60, max_tokens=40))  # 99 tokens of KV = 7 blocks
    used = req("used", 5)
    used.num_computed_tokens = 3
    with pytest.raises(ValueError, match="not fresh"):
        sched.add_request(used)
    assert list(sched.requests) == ["a"] and sched.num_waiting == 1


class FakeConnector:
    """Supplies 16 tokens of KV from outside for every fresh request; the load ends
    (ok, or failed after ``ok_tokens``) when the test says so."""

    def __init__(self):
        self.allocated = []
        self.finished = []
        self.results = []
        self.keep = False
        self.sent = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 16 if not request.num_preemptions else 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated.append((request.req_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        return None

    def get_finished_loads(self):
        out, self.results = self.results, []
        return out

    def get_finished_sending(self):
        out, self.sent = self.sent, set()
        return out

    def request_finished(self, request, block_ids):
        self.finished.append((request.req_id, list(block_ids)))
        return self.keep


def test_kv_connector_seam():
    from kvserve.kv_transfer.connector import LoadResult

    kv = KVCacheManager(100, 16, 256)
    connector = FakeConnector()
    sched = MixedScheduler(SchedulerConfig(max_model_len=256), kv, kv_connector=connector)
    sched.add_request(req("a", 40, max_tokens=1))
    out: SchedulerOutput = sched.schedule()
    # Parked with one block for the external tokens, nothing computed yet.
    assert out.is_empty and list(sched.waiting_for_remote) == ["a"]
    assert connector.allocated[-1] == ("a", kv.get_block_ids("a"), 16)
    assert len(kv.get_block_ids("a")) == 1 and sched.has_unfinished_requests()
    assert sched.schedule().is_empty  # still waiting
    connector.results.append(LoadResult("a", 16))
    sched.poll_kv_connector()
    out = sched.schedule()
    assert out.cached_seq_len == {"a": 16} and out.num_scheduled_tokens == {"a": 24}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    block_ids = kv.get_block_ids("a")
    sched.update_from_output(out, ModelRunnerOutput({"a": [1]}))
    assert connector.finished == [("a", block_ids)] and kv.num_active_blocks == 0


def test_kv_connector_failed_load_and_delayed_free():
    from kvserve.kv_transfer.connector import LoadResult

    kv = KVCacheManager(100, 16, 256)
    connector = FakeConnector()
    sched = MixedScheduler(SchedulerConfig(max_model_len=256), kv, kv_connector=connector)
    # A failed load that is not fatal resumes from what arrived (here nothing).
    sched.add_request(req("a", 40, max_tokens=1))
    sched.schedule()
    connector.results.append(LoadResult("a", 0, error="peer gone"))
    sched.poll_kv_connector()
    out = sched.schedule()
    assert out.cached_seq_len == {"a": 0} and out.num_scheduled_tokens == {"a": 40}
    # The connector keeps the blocks of a finished request until it lets them go.
    connector.keep = True
    sched.update_from_output(out, ModelRunnerOutput({"a": [1]}))
    assert kv.num_active_blocks == 3 and list(sched.sending) == ["a"]
    connector.sent = {"a"}
    sched.poll_kv_connector()
    assert kv.num_active_blocks == 0 and not sched.sending
    # A fatal failure ends the request with the error; an abort while parked frees.
    connector.keep = False
    sched.add_request(req("b", 40, max_tokens=1))
    sched.add_request(req("c", 40, max_tokens=1))
    sched.schedule()
    assert set(sched.waiting_for_remote) == {"b", "c"}
    connector.results.append(LoadResult("b", 0, error="boom", fatal=True))
    sched.poll_kv_connector()
    assert [(r.req_id, e) for r, e in sched.failed_requests] == [("b", "boom")]
    sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert kv.num_active_blocks == 0 and not sched.has_unfinished_requests()
    kv.check_invariants()


# ---------------------------------------------------------------- in-flight prefixes


def shared_prefix_burst(sched, n, prefix_len, suffix_len=64, max_tokens=2, start=50_000):
    prefix = list(range(start, start + prefix_len))
    reqs = []
    for i in range(n):
        suffix = list(
            range(start + prefix_len + i * suffix_len, start + prefix_len + (i + 1) * suffix_len)
        )
        r = Request(f"r{i}", prefix + suffix, SamplingParams(max_tokens=max_tokens))
        sched.add_request(r)
        reqs.append(r)
    return reqs


def test_burst_on_one_new_prefix_computes_it_once():
    # 8 requests arrive together on one uncached 1,024-token prefix: the first
    # computes it, the others wait one step for it and then compute only their
    # 64-token suffixes (without the deferral: r1 would compute the prefix again).
    sched, kv = make(max_num_batched_tokens=2048)
    reqs = shared_prefix_burst(sched, 8, 1024)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 1088}
    assert [r.req_id for r in sched.waiting] == [f"r{i}" for i in range(1, 8)]
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 1} | {f"r{i}": 64 for i in range(1, 8)}
    assert out.cached_seq_len == {"r0": 1088} | {f"r{i}": 1024 for i in range(1, 8)}
    assert all(r.num_cached_tokens == 1024 for r in reqs[1:])
    while sched.has_unfinished_requests():
        run_step(sched)
    assert kv.num_active_blocks == 0
    kv.check_invariants()


def test_deferred_request_follows_a_chunked_owner_and_never_recomputes_its_blocks():
    # Chunks of 512: r0 computes the 1,024-token prefix in two; r1 waits while the
    # block it needs next is in flight, picks up what is cached, and waits again.
    sched, kv = make(max_num_batched_tokens=1024, long_prefill_token_threshold=512)
    _, r1 = shared_prefix_burst(sched, 2, 1024)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 512}
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 512}
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 64, "r1": 64}
    assert out.cached_seq_len["r1"] == 1024 and r1.num_cached_tokens == 1024


def test_short_in_flight_tail_is_recomputed_not_waited_for():
    # A 1,000-token budget leaves r0's last 88 prompt tokens for step 2; of the
    # prefix the followers share, only 32 tokens (2 blocks) are then in flight, at
    # most DEFER_MIN_IN_FLIGHT_TOKENS: they compute those themselves in the same step
    # as r0 instead of starting a step later.
    from kvserve.sched.kv_admission import DEFER_MIN_IN_FLIGHT_TOKENS

    assert DEFER_MIN_IN_FLIGHT_TOKENS >= 32
    sched, kv = make(max_num_batched_tokens=1000)
    shared_prefix_burst(sched, 3, 1024)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 1000}
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 88, "r1": 96, "r2": 96}
    assert out.cached_seq_len == {"r0": 1000, "r1": 992, "r2": 992}
    while sched.has_unfinished_requests():
        run_step(sched)
    assert kv.num_active_blocks == 0
    kv.check_invariants()


def test_deferral_skips_past_to_later_requests_and_ends_when_the_owner_is_aborted():
    sched, kv = make(max_num_batched_tokens=600, long_prefill_token_threshold=256)
    shared_prefix_burst(sched, 2, 1024)
    sched.add_request(req("other", 40, max_tokens=1))
    out, _ = run_step(sched)
    # r1 is deferred (the block it needs is in flight), "other" is admitted past it
    assert out.num_scheduled_tokens == {"r0": 256, "other": 40}
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 256}
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(sched)
    # the owner is gone: r1 computes the rest itself, from the 32 blocks r0 cached
    assert out.num_scheduled_tokens == {"r1": 576}  # alone now: no cap
    assert out.cached_seq_len == {"r1": 512}
    while sched.has_unfinished_requests():
        run_step(sched)
    assert kv.num_active_blocks == 0
    kv.check_invariants()


def test_no_deferral_without_prefix_caching():
    sched, kv = make(max_num_batched_tokens=2048, enable_prefix_caching=False)
    shared_prefix_burst(sched, 2, 1024)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r0": 1088, "r1": 960}


# ---------------------------------------------------------------- prompt budget with decodes


def test_prefill_budget_with_decodes_bounds_prompt_work_only_in_steps_that_decode(tmp_path):
    # Budget 2048, at most 512 prompt tokens beside decodes: the first step (nothing
    # decoding) takes 2048 prompt tokens; once a and b decode, steps carry 2 decodes +
    # 512 prompt tokens; after the decodes end the whole budget is back.
    workload = [
        {"id": "a", "prompt_len": 1024, "max_tokens": 6},
        {"id": "b", "prompt_len": 1024, "max_tokens": 6},
        {"id": "c", "prompt_len": 4096, "max_tokens": 2},
    ]
    result = simulate(
        tmp_path,
        workload,
        "--max-num-batched-tokens",
        "2048",
        "--prefill-budget-with-decodes",
        "512",
    )
    assert result["config"]["prefill_budget_with_decodes"] == 512
    steps = [s["num_scheduled_tokens"] for s in result["steps"]]
    assert steps[0] == {"a": 1024, "b": 1024}
    for s in steps[1:6]:
        assert s == {"a": 1, "b": 1, "c": 512}
    assert steps[6]["c"] == 4096 - 5 * 512  # no decodes left: the rest at once
    assert chunks(result, "c")[0] == (512, 0)


def test_prefill_budget_with_decodes_is_validated():
    from kvserve.config import SchedulerConfig

    with pytest.raises(ValueError, match="prefill_budget_with_decodes"):
        SchedulerConfig(prefill_budget_with_decodes=-1).validate()


def test_short_prompts_join_whole_past_the_prompt_bound_with_decodes():
    # With decodes running the prompt bound is 256: s0 and s1 fit in it; s2 and s3
    # (100 tokens each, under SHORT_PROMPT_TOKENS) still join whole, as the step
    # budget has room; the 300-token prompt behind them waits for the next step.
    from kvserve.sched.mixed import SHORT_PROMPT_TOKENS

    assert SHORT_PROMPT_TOKENS >= 100
    sched, kv = make(max_num_batched_tokens=2048, prefill_budget_with_decodes=256)
    sched.add_request(req("d", 40, max_tokens=20))
    run_step(sched)
    for i in range(4):
        sched.add_request(req(f"s{i}", 100, max_tokens=2))
    sched.add_request(req("long", 300, max_tokens=2))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"d": 1} | {f"s{i}": 100 for i in range(4)}
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens["long"] == 256  # the bound again
    while sched.has_unfinished_requests():
        run_step(sched)
    assert kv.num_active_blocks == 0
    kv.check_invariants()


def test_short_prompt_overflow_stays_within_the_step_budget():
    # The step budget (300 here) still bounds the overflow: with 1 decode, 100 + 100
    # fill the prompt bound of 200, the third short prompt fits the 99 left of the
    # step budget only in part, so it waits.
    sched, kv = make(max_num_batched_tokens=300, prefill_budget_with_decodes=200)
    sched.add_request(req("d", 40, max_tokens=20))
    run_step(sched)
    for i in range(3):
        sched.add_request(req(f"s{i}", 100, max_tokens=2))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"d": 1, "s0": 100, "s1": 100}
    kv.check_invariants()
