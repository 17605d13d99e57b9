"""The engine thread of AsyncEngine (kvserve.engine.engine_loop) on a real EngineCore
over the fake runner: burst waits and held adds, and a failing step failing only its
requests. The event-loop side: tests/engine/test_async_engine.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.fake_runner import fake_engine

from kvserve.config import AdmissionConfig, SchedulerConfig
from kvserve.engine.async_engine import AsyncEngine, RequestFailedError
from kvserve.request import SamplingParams


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvserve.model.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


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
