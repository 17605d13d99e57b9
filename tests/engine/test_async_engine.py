"""AsyncEngine (kvserve.engine.async_engine) on a real EngineCore over the fake runner:
burst waits and held adds, queue limits, streams left early, shutdown, failing steps
and refused requests. The HTTP server over it: tests/entrypoints/test_server_fake.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from support.fake_runner import fake_engine

from kvserve.config import AdmissionConfig, SchedulerConfig
from kvserve.engine.async_engine import (
    AsyncEngine,
    EngineUnavailableError,
    QueueFullError,
    RequestFailedError,
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


def test_failing_engine_step_fails_its_requests_only(tokenizer: Any) -> None:
    core, _ = fake_engine(tokenizer)
    engine = AsyncEngine(core)
    real_step = core.step

    def broken_step() -> Any:
        core.step = real_step  # type: ignore[method-assign]
        raise RuntimeError("scheduler bug")

    async def run() -> None:
        stream = await engine.generate([5, 6], SamplingParams(max_tokens=200))
        core.step = broken_step  # type: ignore[method-assign]
        with pytest.raises(RequestFailedError, match="scheduler bug"):
            _ = [d async for d in stream]
        deltas = [d async for d in await engine.generate([7, 8], SamplingParams(max_tokens=3))]
        assert deltas[-1].finish_reason == "length" and engine.is_healthy
        await engine.shutdown()

    asyncio.run(run())
    assert 'finished_reason="error"' in engine.metrics.render().decode()
    core.check_no_leaks()


@pytest.mark.parametrize("batch_wait_ms", [40.0, 0.0])
def test_idle_engine_takes_a_burst_as_one_batch(tokenizer: Any, batch_wait_ms: float) -> None:
    """Requests handed over 3 ms apart to an idle engine: with a burst wait they all
    run in its first step; without one the first step holds the first request alone.
    Once busy, the engine does not wait again."""
    core, runner = fake_engine(tokenizer, batch_wait_ms=batch_wait_ms, step_s=0.02)
    engine = AsyncEngine(core)

    async def run() -> None:
        streams = []
        for i in range(4):
            streams.append(await engine.generate([5, 6 + i], SamplingParams(max_tokens=3)))
            await asyncio.sleep(0.003)
        for stream in streams:
            assert [d async for d in stream][-1].finish_reason == "length"
        await engine.shutdown()

    asyncio.run(run())
    if batch_wait_ms:
        assert runner.step_sizes == [4, 4, 4]
    else:
        assert runner.step_sizes[0] == 1 and len(runner.step_sizes) > 3
    core.check_no_leaks()


@pytest.mark.parametrize("batch_wait_ms", [40.0, 0.0])
def test_busy_engine_starts_a_burst_in_one_step(tokenizer: Any, batch_wait_ms: float) -> None:
    """A burst reaching a busy engine 8 ms apart: with a burst wait its requests are
    held while it arrives (the running request keeps stepping) and join in one step;
    without one they join over several steps. Every block is accounted for after."""
    core, runner = fake_engine(tokenizer, batch_wait_ms=batch_wait_ms, step_s=0.01)
    engine = AsyncEngine(core)

    async def run() -> None:
        first = await engine.generate([5, 6], SamplingParams(max_tokens=60))
        await asyncio.sleep(0.1)  # past the idle engine's own burst wait
        before = len(runner.step_sizes)
        tasks = []  # concurrent hand-overs, as separate HTTP requests make them
        for i in range(4):
            tasks.append(
                asyncio.ensure_future(engine.generate([7, 8 + i], SamplingParams(max_tokens=3)))
            )
            await asyncio.sleep(0.008)
        streams = await asyncio.gather(*tasks)
        for stream in [first, *streams]:
            assert [d async for d in stream][-1].finish_reason == "length"
        await engine.shutdown()
        sizes = runner.step_sizes[before:]
        grown = [n for n in sizes if n > 1]
        if batch_wait_ms:
            assert grown[0] == 5, sizes  # all four joined the running request at once
            assert min(sizes[: sizes.index(5)]) == 1, "the running request kept stepping"
        else:
            assert grown[0] < 5, sizes

    asyncio.run(run())
    core.check_no_leaks()


def test_held_burst_request_can_be_aborted(tokenizer: Any) -> None:
    """A request held while its burst arrives and then cancelled by its client is
    dropped before it reaches the engine; the queue count returns to zero."""
    core, _ = fake_engine(tokenizer, batch_wait_ms=60.0, step_s=0.01)
    engine = AsyncEngine(core)

    async def run() -> None:
        first = await engine.generate([5, 6], SamplingParams(max_tokens=60))
        await asyncio.sleep(0.1)  # past the idle engine's own burst wait
        task = asyncio.ensure_future(engine.generate([7, 8], SamplingParams(max_tokens=3)))
        await asyncio.sleep(0.02)
        assert not task.done() and engine.num_waiting() == 1  # held, not yet added
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [d async for d in first][-1].finish_reason == "length"
        assert engine.num_waiting() == 0
        await engine.shutdown()

    asyncio.run(run())
    core.check_no_leaks()


def test_batch_wait_ms_is_validated() -> None:
    with pytest.raises(ValueError, match="batch_wait_ms"):
        AdmissionConfig(batch_wait_ms=-1).validate()
    with pytest.raises(TypeError):  # one owner: the scheduler has no such field
        SchedulerConfig(batch_wait_ms=10)  # type: ignore[call-arg]


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
