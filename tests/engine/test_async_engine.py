"""AsyncEngine's event-loop side (kvserve.engine.async_engine) on a real EngineCore
over the fake runner: queue limits, streams left early, shutdown and refused
requests. Its engine thread (burst waits, held adds, failing steps):
tests/engine/test_engine_loop.py. The HTTP server over it:
tests/entrypoints/test_server_fake.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from support.fake_runner import fake_engine

from kvserve.engine.async_engine import (
    AsyncEngine,
    EngineUnavailableError,
    QueueFullError,
)
from kvserve.request import SamplingParams


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvserve.model.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def _wait(cond: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_queue_full_counts_adds_not_yet_taken(tokenizer: Any) -> None:
    core, runner = fake_engine(tokenizer, max_num_seqs=1)
    engine = AsyncEngine(core)
    params = SamplingParams(max_tokens=2)

    async def run() -> None:
        first = await engine.generate([5, 6], SamplingParams(max_tokens=250))
        await first.__anext__()  # running, and the stats snapshot says so
        runner.gate.clear()  # the engine thread blocks in its next step
        await asyncio.sleep(0.05)
        second = asyncio.create_task(engine.generate([7, 8], params, max_waiting=1))
        await asyncio.sleep(0)  # its add is queued but not taken by the blocked thread
        assert engine.num_waiting() == 1
        with pytest.raises(QueueFullError, match="limit is 1"):
            await engine.generate([9, 10], params, max_waiting=1)
        runner.gate.set()
        first.abort()
        deltas = [d async for d in await second]
        assert deltas[-1].finish_reason == "length"
        assert engine.num_waiting() == 0
        await engine.shutdown()

    asyncio.run(run())


def test_leaving_a_stream_early_aborts_the_request(tokenizer: Any) -> None:
    core, _ = fake_engine(tokenizer, step_s=0.01)
    engine = AsyncEngine(core)

    async def run() -> None:
        stream = await engine.generate([5, 6], SamplingParams(max_tokens=200))
        async with stream:
            async for delta in stream:
                assert delta.new_token_ids
                break
        assert await asyncio.to_thread(_wait, lambda: not core.has_unfinished_requests())
        assert engine.stats().num_active_blocks == 0
        await engine.shutdown()

    asyncio.run(run())
    text = engine.metrics.render().decode()
    assert (
        'kvserve:request_success_total{finished_reason="abort",model_name="fake-model"} 1.0' in text
    )


def test_shutdown_drains_cuts_the_rest_and_refuses_new(tokenizer: Any) -> None:
    core, _ = fake_engine(tokenizer, step_s=0.01)
    engine = AsyncEngine(core)

    async def run() -> None:
        stream = await engine.generate([5, 6], SamplingParams(max_tokens=200))
        first = await stream.__anext__()
        assert not first.finished
        short = await engine.generate([5, 7], SamplingParams(max_tokens=2))
        t0 = time.monotonic()
        await engine.shutdown(drain_timeout_s=0.3)
        assert time.monotonic() - t0 >= 0.3  # the long one was waited for, then cut
        with pytest.raises(EngineUnavailableError, match="shut down before"):
            async for _ in stream:
                pass
        drained = [d async for d in short]  # finished within the drain
        assert drained[-1].finish_reason == "length"
        assert not core.has_unfinished_requests() and not engine.is_healthy
        assert core.kv_cache_manager.num_active_blocks == 0
        await engine.shutdown()  # a second call returns
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            await engine.generate([5, 6], SamplingParams(max_tokens=2))

    asyncio.run(run())


def test_bad_request_is_refused_before_queueing(tokenizer: Any) -> None:
    core, _ = fake_engine(tokenizer, max_model_len=64)
    engine = AsyncEngine(core)

    async def run() -> None:
        with pytest.raises(ValueError, match="lower max_tokens to at most 62"):
            await engine.generate([5, 6], SamplingParams(max_tokens=100))
        assert engine.num_waiting() == 0 and engine.stats().num_seqs_unfinished == 0
        await engine.shutdown()

    asyncio.run(run())


def test_shutdown_returns_as_soon_as_nothing_is_in_flight(tokenizer: Any) -> None:
    core, _ = fake_engine(tokenizer, step_s=0.002)
    engine = AsyncEngine(core)

    async def run() -> float:
        stream = await engine.generate([5, 6], SamplingParams(max_tokens=3))
        t0 = time.monotonic()
        await engine.shutdown(drain_timeout_s=30.0)
        assert [d async for d in stream][-1].finish_reason == "length"
        return time.monotonic() - t0

    assert asyncio.run(run()) < 5.0
