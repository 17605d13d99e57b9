"""Admission (kvserve/engine/request_limits.py): sequences (prompts x n) are counted per
request against max_num_seqs + --max-queue-len, a request is admitted or refused
whole, --max-prompts-per-request bounds a batch, and the burst gate holds adds.
Issue 21 item 4: one request of 1,000 prompts x n=4 used to be admitted under
--max-queue-len 2 and to run 160 sequences with max_num_seqs 64."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from support.fake_runner import fake_engine
from support.server_helpers import scrape, serve_thread

from kvserve.engine.async_engine import AsyncEngine, QueueFullError
from kvserve.engine.request_limits import (
    AddNow,
    Admitted,
    BurstGate,
    Held,
    RefusalReason,
    Refused,
    admit_sequences,
    check_prompt_count,
)
from kvserve.entrypoints.openai_server import build_app
from kvserve.request import RequestError, SamplingParams


# ---------------------------------------------------------------------- pure rules
def test_admit_sequences_counts_the_whole_request() -> None:
    kw: dict[str, Any] = {"max_num_seqs": 64, "max_queue_len": 2}
    assert admit_sequences(4000, in_system=0, **kw) == Refused(
        RefusalReason.TOO_LARGE, admit_sequences(4000, in_system=0, **kw).message
    )
    assert admit_sequences(66, in_system=0, **kw) == Admitted(66)
    full = admit_sequences(3, in_system=64, **kw)
    assert isinstance(full, Refused) and full.reason is RefusalReason.QUEUE_FULL
    assert full.retry_after_s is not None and "limit is 2" in full.message
    assert admit_sequences(2, in_system=64, **kw) == Admitted(2)
    assert admit_sequences(10**6, in_system=10**6, max_num_seqs=1, max_queue_len=None) == Admitted(
        10**6
    )
    with pytest.raises(ValueError):
        admit_sequences(0, in_system=0, **kw)


def test_prompt_count_limit() -> None:
    check_prompt_count(256, 256)
    check_prompt_count(10**5, None)
    with pytest.raises(RequestError, match="at most 256 per request") as info:
        check_prompt_count(257, 256)
    assert info.value.param == "prompt"


def test_burst_gate_holds_until_the_burst_ends() -> None:
    gate: BurstGate[str] = BurstGate(10.0, max_factor=8)  # 10 ms gap, 80 ms at most
    assert gate.offer("idle", 0.0, busy=False) == AddNow()
    assert gate.offer("a", 0.0, busy=True) == Held()
    assert gate.offer("b", 0.005, busy=True) == Held()
    assert gate.release(0.012, busy=True) == []  # b arrived 7 ms ago
    assert gate.release(0.016, busy=True) == ["a", "b"]  # 11 ms without an arrival
    for i in range(20):  # a steady trickle: released after 80 ms whatever comes
        gate.offer(str(i), 0.005 * i, busy=True)
    assert gate.release(0.079, busy=True) == []
    assert len(gate.release(0.081, busy=True)) == 20
    gate.offer("x", 1.0, busy=True)
    assert gate.release(1.0, busy=False) == ["x"]  # nothing else to run: at once
    gate.offer("y", 2.0, busy=True)
    gate.offer("z", 2.0, busy=True)
    assert gate.remove_where(lambda s: s == "y") == ["y"] and gate.take_all() == ["z"]
    off: BurstGate[str] = BurstGate(0.0)
    assert off.offer("a", 0.0, busy=True) == AddNow() and not off.enabled


# ---------------------------------------------------------------------- the engine front
@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvserve.model.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def test_async_engine_admits_all_or_nothing(tokenizer: Any) -> None:
    core, runner = fake_engine(tokenizer, max_num_seqs=8)
    engine = AsyncEngine(core)
    params = SamplingParams(max_tokens=30, n=2)

    async def run() -> None:
        batch = [core.make_request([5, 6, i], params, request_id=f"a{i}") for i in range(4)]
        first = await engine.submit_all(batch, max_waiting=2)  # 8 sequences: room
        assert [len(g) for g in first] == [2, 2, 2, 2]
        second = [core.make_request([7, i], params, request_id=f"b{i}") for i in range(2)]
        with pytest.raises(QueueFullError, match="limit is 2"):
            await engine.submit_all(second, max_waiting=2)  # 8 + 4 > 8 + 2
        assert not any(r.startswith("b") for r in engine._requests)
        huge = [core.make_request([7, i], params, request_id=f"c{i}") for i in range(6)]
        with pytest.raises(RequestError, match="12 sequences"):
            await engine.submit_all(huge, max_waiting=2)  # never fits 8 + 2
        for group in first:
            for stream in group:
                deltas = [d async for d in stream]
                assert deltas[-1].finish_reason == "length"
        await engine.shutdown()

    asyncio.run(run())
    assert max(runner.step_sizes) <= 8
    assert not core.has_unfinished_requests() and core.kv_cache_manager.num_active_blocks == 0
    core.check_no_leaks()


def test_a_refused_add_aborts_the_rest_of_its_request(tokenizer: Any) -> None:
    core, _ = fake_engine(tokenizer, max_num_seqs=8)
    engine = AsyncEngine(core)

    async def run() -> None:
        taken = core.make_request([5, 6], SamplingParams(max_tokens=200), request_id="dup")
        stream = await engine.submit(taken)
        ok = core.make_request([5, 7], SamplingParams(max_tokens=200), request_id="fresh")
        again = core.make_request([5, 8], SamplingParams(max_tokens=2), request_id="dup")
        with pytest.raises(RequestError, match="already in use"):
            await engine.submit_all([ok, again])
        stream.abort()
        deadline = time.monotonic() + 10
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await engine.shutdown()

    asyncio.run(run())
    assert core.abort_requests("fresh") == []  # not live: nothing to abort
    assert core.kv_cache_manager.num_active_blocks == 0
    core.check_no_leaks()


def test_http_batch_refused_whole_and_never_over_max_num_seqs(tokenizer: Any) -> None:
    core, runner = fake_engine(tokenizer, max_num_seqs=8, step_s=0.005)
    app = build_app(AsyncEngine(core), max_queue_len=2, max_prompts_per_request=256)
    with serve_thread(app) as url:
        # The probe: 1,000 prompts x n=4 under --max-queue-len 2.
        body = {"prompt": [[5, 6 + i % 50] for i in range(1000)], "max_tokens": 4, "n": 4}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "at most 256" in r.json()["error"]["message"]
        body["prompt"] = body["prompt"][:200]  # under the prompt limit: 800 sequences
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "800 sequences" in r.json()["error"]["message"]
        stats = scrape(url)
        assert stats["kvserve:num_requests_waiting"] == 0
        assert stats["kvserve:num_requests_running"] == 0

        # A long request fills the engine; the next batch does not fit beside it: 429.
        long = {"prompt": [[5, 6 + i] for i in range(4)], "max_tokens": 150, "n": 2}
        with httpx.Client(timeout=60) as http:
            req = http.build_request("POST", url + "/v1/completions", json={**long, "stream": True})
            streaming = http.send(req, stream=True)
            lines = streaming.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            refused = http.post(
                url + "/v1/completions",
                json={"prompt": [[7, 8], [7, 9]], "max_tokens": 2, "n": 2},
            )
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["code"] == "queue_full"
            ok = http.post(url + "/v1/completions", json={"prompt": [7, 8], "max_tokens": 2})
            assert ok.status_code == 200  # 8 running + 1 waiting <= 8 + 2
            events = [line for line in lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
        stats = scrape(url)
    assert max(runner.step_sizes) <= 8
    assert stats["kvserve:num_requests_running"] == 0
    assert stats["kvserve:num_requests_waiting"] == 0
    assert stats["kvserve:num_active_blocks"] == 0
    core.check_no_leaks()
