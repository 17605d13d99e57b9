"""The async engine and the HTTP layer over the real EngineCore on a fake model runner
(no model weights): fault isolation, shutdown, queue accounting, early-exit aborts,
metrics rendering."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.fake_runner import POISON_TOKEN, fake_engine
from support.server_helpers import scrape, serve_thread

from kvserve.config import AdmissionConfig, SchedulerConfig
from kvserve.engine.async_engine import (
    AsyncEngine,
    EngineUnavailableError,
    QueueFullError,
    RequestFailedError,
)
from kvserve.engine.engine_core import EngineCore
from kvserve.engine.outputs import EngineStats
from kvserve.entrypoints.openai_server import build_app
from kvserve.metrics import EngineMetrics
from kvserve.request import SamplingParams


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvserve.model.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture
def fake_server(tokenizer: Any) -> Iterator[tuple[str, EngineCore]]:
    core, _ = fake_engine(tokenizer)
    with serve_thread(build_app(AsyncEngine(core))) as url:
        yield url, core


def _wait(cond: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_failing_request_does_not_take_the_engine_down(
    fake_server: tuple[str, EngineCore],
) -> None:
    url, core = fake_server
    bad = {"prompt": [5, POISON_TOKEN], "max_tokens": 4}
    r = httpx.post(url + "/v1/completions", json=bad, timeout=30)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    with httpx.stream("POST", url + "/v1/completions", json={**bad, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"

    ok = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(url + "/health").status_code == 200
    stats = scrape(url)
    # The runner failed: the engine aborted the requests of those steps and went on.
    assert stats["kvserve:request_success_total{finished_reason=abort}"] == 2
    assert stats["kvserve:num_active_blocks"] == 0 and core.num_failed_steps == 2
    core.check_no_leaks()


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


def test_openai_client_batch_prompts_and_echo(fake_server: tuple[str, EngineCore]) -> None:
    url, _ = fake_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model="fake-model", prompt=["Hello", "World"], max_tokens=3, echo=True
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text.startswith("Hello") and out.choices[1].text.startswith("World")
    assert out.usage is not None and out.usage.completion_tokens == 6
    chunks = list(
        client.completions.create(
            model="fake-model",
            prompt=[[5, 6], [7, 8, 9]],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    finished = sorted(
        c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason
    )
    assert finished == [0, 1]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 5


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
        assert engine.num_in_flight == 0 and engine.num_waiting() == 0
        await engine.shutdown()

    asyncio.run(run())


def test_metrics_render_parses_with_engine_state() -> None:
    metrics = EngineMetrics("m")
    metrics.set_stats_source(
        lambda: EngineStats(num_requests_running=3, num_active_blocks=7, scheduler_state="IDLE")
    )
    metrics.count_prompt_tokens(5)
    metrics.observe_ttft(0.2)
    metrics.count_finished("stop")
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert families["kvserve:num_requests_running"].samples[0].value == 3
    assert families["kvserve:num_active_blocks"].samples[0].value == 7
    assert families["kvserve:prompt_tokens"].type == "counter"
    ttft = families["kvserve:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    assert {s.name: s.value for s in ttft.samples}["kvserve:time_to_first_token_seconds_count"] == 1
    state = families["kvserve:scheduler_state"].samples[0]
    assert state.labels == {"model_name": "m", "state": "IDLE"} and state.value == 1
    # two engines in one process keep separate registries
    other = EngineMetrics("m")
    assert "kvserve:prompt_tokens_total" in other.render().decode()
    assert 'prompt_tokens_total{model_name="m"} 0.0' in other.render().decode()


def test_tokenize_and_detokenize_shapes(fake_server: tuple[str, EngineCore]) -> None:
    url, _ = fake_server
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["count"] == len(body["tokens"]) == 2 and body["max_model_len"] == 256
    assert body["token_strs"] == ["Hello", "\u0120world"]
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    ids = chat.json()["tokens"]
    text = httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


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
