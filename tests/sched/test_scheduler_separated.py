"""Separated policy: prefill XOR decode, holdback admission, bucket padding, KV
admission control (deadlock case) and the IDLE/ACTIVE_PREFILL/ACTIVE_DECODE states."""

from __future__ import annotations

import json

import pytest

from kvserve.config import SchedulerConfig
from kvserve.kv_cache import KVCacheManager
from kvserve.request import Request, SamplingParams
from kvserve.sched import SchedulerState, SeparatedScheduler, make_scheduler
from kvserve.sched.output import ModelRunnerOutput
from kvserve.sched.step_builder import StepBuilder
from kvserve.sim.cli import main as simulate_main


def simulate(tmp_path, workload, *flags):
    path = tmp_path / "workload.json"
    path.write_text(json.dumps({"requests": workload}))
    out = tmp_path / "out.json"
    assert simulate_main([str(path), "--policy", "separated", *flags, "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["scheduler_policy"] == "separated"
    assert_separated(result)
    return result


def assert_separated(result):
    """No step mixes phases; a prefill step holds one request; decode steps are padded."""
    for s in result["steps"]:
        assert s["phase"] != "mixed", s
        if s["phase"] == "prefill":
            assert len(s["num_scheduled_tokens"]) == 1, s
            assert s["decode_batch_padded"] is None
        if s["phase"] == "decode":
            assert s["decode_batch_padded"] >= len(s["num_scheduled_tokens"])
            assert set(s["num_scheduled_tokens_padded"].values()) == {1}


def prefill_chunks(result, req_id):
    """(actual, padded, num_computed before) of ``req_id``'s prefill steps."""
    return [
        (
            s["num_scheduled_tokens"][req_id],
            s["num_scheduled_tokens_padded"][req_id],
            s["num_computed_tokens"][req_id],
        )
        for s in result["steps"]
        if s["phase"] == "prefill" and req_id in s["num_scheduled_tokens"]
    ]


def test_prefill_chunks_pad_to_the_smallest_bucket(tmp_path):
    sizes = (50, 127, 128, 129, 1500, 5000)
    result = simulate(
        tmp_path,
        [{"id": f"p{n}", "prompt_len": n, "max_tokens": 1} for n in sizes],
        "--max-num-batched-tokens", "8192", "--max-model-len", "8192",
    )  # fmt: skip
    assert result["config"]["num_batched_tokens_buckets"] == [128, 256, 512, 1024, 2048, 4096, 8192]
    padded = {n: prefill_chunks(result, f"p{n}") for n in sizes}
    assert padded == {
        50: [(50, 128, 0)],
        127: [(127, 128, 0)],
        128: [(128, 128, 0)],
        129: [(129, 256, 0)],
        1500: [(1500, 2048, 0)],
        5000: [(5000, 8192, 0)],
    }
    expected_padding = (128 - 50) + (128 - 127) + 0 + (256 - 129) + (2048 - 1500) + (8192 - 5000)
    assert result["summary"]["total_padding_tokens"] == expected_padding
    # One prefill per step, FIFO.
    assert [next(iter(s["num_scheduled_tokens"])) for s in result["steps"]] == [
        f"p{n}" for n in sizes
    ]


def test_1000_cached_of_5000_is_4000_actual_4096_padded(tmp_path):
    prefix = {"id": "sys", "len": 1000}
    result = simulate(
        tmp_path,
        [
            {"id": "S", "prompt_len": 1000, "max_tokens": 1, "shared_prefix": prefix},
            {"id": "B", "arrival_step": 1, "prompt_len": 5000, "max_tokens": 2, "shared_prefix": prefix},
        ],
        "--max-num-batched-tokens", "8192", "--max-model-len", "8192", "--block-size", "8",
    )  # fmt: skip
    assert prefill_chunks(result, "B") == [(4000, 4096, 1000)]
    assert result["requests"]["B"]["num_cached_tokens"] == 1000
    # num_computed_tokens advanced by the actual count: the next step decodes at 5000.
    b_steps = [s for s in result["steps"] if "B" in s["num_scheduled_tokens"]]
    assert b_steps[1]["phase"] == "decode" and b_steps[1]["num_computed_tokens"]["B"] == 5000


def test_three_decodes_pad_to_a_batch_of_four(tmp_path):
    result = simulate(
        tmp_path,
        [{"id": f"d{i}", "prompt_len": 10, "max_tokens": 5} for i in range(3)],
        "--max-num-seqs", "8", "--num-seqs-buckets", "1,2,4,8",
    )  # fmt: skip
    phases = [s["phase"] for s in result["steps"]]
    assert phases == ["prefill"] * 3 + ["decode"] * 4
    for s in result["steps"][3:]:
        assert len(s["num_scheduled_tokens"]) == 3 and s["decode_batch_padded"] == 4
    assert result["summary"]["total_padding_tokens"] == 3 * (128 - 10) + 4 * 1


def test_10000_prompt_chunks_stay_in_prefill_and_pad(tmp_path):
    result = simulate(
        tmp_path,
        [{"id": "L", "prompt_len": 10000, "max_tokens": 2}],
        "--max-num-batched-tokens", "2048", "--max-model-len", "16384",
        "--no-enable-prefix-caching",
    )  # fmt: skip
    assert prefill_chunks(result, "L") == [
        (2048, 2048, 0), (2048, 2048, 2048), (2048, 2048, 4096), (2048, 2048, 6144),
        (1808, 2048, 8192),
    ]  # fmt: skip


def test_cached_prefix_then_three_chunks_while_decodes_wait(tmp_path):
    prefix = {"id": "sys", "len": 4096}
    result = simulate(
        tmp_path,
        [
            {"id": "S", "prompt_len": 4096, "max_tokens": 30, "shared_prefix": prefix},
            {"id": "L", "arrival_step": 2, "prompt_len": 10240, "max_tokens": 2, "shared_prefix": prefix},
        ],
        "--max-num-batched-tokens", "2048", "--max-model-len", "16384", "--block-size", "128",
    )  # fmt: skip
    assert prefill_chunks(result, "L") == [
        (2048, 2048, 4096), (2048, 2048, 6144), (2048, 2048, 8192),
    ]  # fmt: skip
    # S (decoding) is held back during L's three prefill steps.
    assert [list(s["num_scheduled_tokens"]) for s in result["steps"][2:6]] == [
        ["L"], ["L"], ["L"], ["S", "L"],
    ]  # fmt: skip


def test_kv_admission_control_prevents_the_deadlock(tmp_path):
    # max_num_seqs 8, but KV room for only 2 requests at max_model_len=1024 (64 blocks
    # each, 138 usable); 8 requests that grow to 900 tokens.
    result = simulate(
        tmp_path,
        [{"id": f"r{i}", "prompt_len": 600, "max_tokens": 300} for i in range(8)],
        "--max-num-seqs", "8", "--max-model-len", "1024", "--block-size", "16",
        "--num-kv-blocks", "139",
    )  # fmt: skip
    assert all(r["num_output_tokens"] == 300 for r in result["requests"].values())
    # No step scheduled nothing (the simulator would have stopped with an error) ...
    assert all(s["num_scheduled_tokens"] for s in result["steps"])
    # ... because at most two requests were admitted at once, so nothing was preempted.
    assert max(s["num_running"] for s in result["steps"]) == 2
    assert result["summary"]["num_preemptions"] == 0


def _drive(sched, max_steps=10_000, states=None):
    """Run to completion with a stand-in runner; return the outputs (and append the
    state right after each schedule() to ``states``)."""
    outputs = []
    while sched.has_unfinished_requests():
        assert len(outputs) < max_steps
        out = sched.schedule()
        if states is not None:
            states.append(str(sched.state))
        assert not out.is_empty, "a step scheduled nothing while requests were unfinished"
        sampled = {
            r: [7]
            for r, n in out.num_scheduled_tokens.items()
            if out.cached_seq_len[r] + n == sched.requests[r].num_tokens
        }
        sched.update_from_output(out, ModelRunnerOutput(sampled))
        sched.kv_cache_manager.check_invariants()
        outputs.append(out)
    return outputs


def _requests(n, prompt_len, max_tokens):
    return [
        Request(
            f"r{i}",
            list(range(1000 * i + 1, 1000 * i + 1 + prompt_len)),
            SamplingParams(max_tokens=max_tokens),
        )
        for i in range(n)
    ]


def test_without_admission_control_the_safety_net_still_makes_progress():
    kv = KVCacheManager(139, 16, 1024)
    sched = SeparatedScheduler(
        SchedulerConfig(scheduler_policy="separated", max_num_seqs=8, max_model_len=1024), kv
    )
    assert sched.max_kv_concurrent == 2
    sched.max_kv_concurrent = 8  # switch rule (4) off
    reqs = _requests(8, 600, 300)
    for r in reqs:
        sched.add_request(r)
    outputs = _drive(sched)
    assert all(o.phase in ("prefill", "decode") for o in outputs)
    assert all(r.num_output_tokens == 300 for r in reqs)
    assert sched.num_preemptions > 0  # what rule (4) avoids
    assert kv.num_active_blocks == 0


def test_state_machine_and_prefill_priority():
    kv = KVCacheManager(200, 16, 512)
    sched = make_scheduler(
        SchedulerConfig(
            scheduler_policy="separated", max_num_seqs=2, max_model_len=512,
            max_num_batched_tokens=64,
        ),
        kv,
    )  # fmt: skip
    assert sched.state == SchedulerState.IDLE
    a, b, c = _requests(3, 100, 3)
    for r in (a, b, c):
        sched.add_request(r)
    states: list[str] = []
    outputs = _drive(sched, states=states)
    seen = [
        (o.phase, sorted(o.num_scheduled_tokens), state)
        for o, state in zip(outputs, states, strict=True)
    ]
    assert seen == [
        ("prefill", ["r0"], "ACTIVE_PREFILL"),  # 64 of 100
        ("prefill", ["r0"], "ACTIVE_PREFILL"),  # 36: first token
        ("prefill", ["r1"], "ACTIVE_PREFILL"),  # r0's decode waits: prefill priority
        ("prefill", ["r1"], "ACTIVE_PREFILL"),
        ("decode", ["r0", "r1"], "ACTIVE_DECODE"),  # at capacity (max_num_seqs 2): r2 waits
        ("decode", ["r0", "r1"], "ACTIVE_DECODE"),  # both finish, freeing slots
        ("prefill", ["r2"], "ACTIVE_PREFILL"),
        ("prefill", ["r2"], "ACTIVE_PREFILL"),
        ("decode", ["r2"], "ACTIVE_DECODE"),
        ("decode", ["r2"], "ACTIVE_DECODE"),
    ]
    assert sched.state == SchedulerState.IDLE


def test_decode_batch_never_exceeds_the_token_budget():
    kv = KVCacheManager(200, 16, 256)
    sched = make_scheduler(
        SchedulerConfig(
            scheduler_policy="separated", max_num_seqs=8, max_model_len=256,
            max_num_batched_tokens=3,
        ),
        kv,
    )  # fmt: skip
    reqs = _requests(5, 3, 4)
    for r in reqs:
        sched.add_request(r)
    outputs = _drive(sched)
    assert max(o.total_num_scheduled_tokens for o in outputs) == 3
    assert all(r.num_output_tokens == 4 for r in reqs)


def test_a_mixed_step_is_refused():
    kv = KVCacheManager(100, 16, 256)
    sched = SeparatedScheduler(SchedulerConfig(scheduler_policy="separated", max_model_len=256), kv)
    step = StepBuilder()
    step.prefill_ids.append("p")
    step.decode_ids.append("d")
    with pytest.raises(RuntimeError, match="prefill.*and decode.*same step"):
        sched._pad(step)
