"""The async engine and the HTTP layer over the real EngineCore on a fake model runner
(no model weights): fault isolation, shutdown, queue accounting, early-exit aborts,
metrics rendering."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.fake_runner import POISON_TOKEN, fake_engine
from support.server_helpers import scrape, serve_thread

from kvserve.engine.async_engine import (
    AsyncEngine,
)
from kvserve.engine.engine_core import EngineCore
from kvserve.engine.metrics import EngineMetrics
from kvserve.engine.outputs import EngineStats
from kvserve.entrypoints.openai_server import build_app


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvserve.model.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture
def fake_server(tokenizer: Any) -> Iterator[tuple[str, EngineCore]]:
    core, _ = fake_engine(tokenizer)
    with serve_thread(build_app(AsyncEngine(core))) as url:
        yield url, core


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
