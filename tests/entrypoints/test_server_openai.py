"""The real ``kvserve serve`` on the default model, driven by the official ``openai`` client."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import openai
import pytest
from support.server_helpers import ServerProcess, scrape, wait_for_metric

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def client(kvserve_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=kvserve_server.base_url + "/v1", api_key=kvserve_server.api_key, max_retries=0
    )


MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Name three colors."}]


def test_models_and_health(kvserve_server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(kvserve_server.base_url + "/health").status_code == 200


def test_completion_greedy_stream_matches_non_stream(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert full.usage is not None and full.usage.completion_tokens <= 8
    assert full.usage.prompt_tokens == 5
    assert choice.text

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_chat_non_stream_and_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.usage is not None and 0 < full.usage.completion_tokens <= 12

    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_max_tokens_defaults(client: openai.OpenAI) -> None:
    # completions: OpenAI's default of 16 tokens
    out = client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 16
    assert out.choices[0].finish_reason == "length"
    # chat: max_completion_tokens is accepted as the newer spelling
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 3


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=MODEL,
            prompt="My favourite word is",
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    others = {sample(s) for s in (1, 2, 3)}
    assert others != {first}  # a different seed samples differently


def test_stop_string(client: openai.OpenAI) -> None:
    prompt = "Here is a list of fruits: apple, banana,"
    free = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    words = free.text.split()
    assert len(words) >= 3
    stop = words[2]
    cut = free.text[: free.text.index(stop)]
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "\u2603"]
    )
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    # a plain string is accepted too
    out2 = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=stop
    )
    assert out2.choices[0].text == cut


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=5, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert lp is not None and out.usage is not None
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0
        assert 2 <= len(top) <= 3 and token in top
        # greedy: the sampled token is the most likely one
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_logprobs_and_stream_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    content = out.choices[0].logprobs.content
    assert content is not None and len(content) == 6
    assert b"".join(bytes(e.bytes) for e in content).decode() == out.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-4)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        stream=True,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_multiple_prompts_and_token_ids(
    client: openai.OpenAI, kvserve_server: ServerProcess
) -> None:
    ids = httpx.post(
        kvserve_server.base_url + "/tokenize",
        json={"prompt": "The sky is"},
        headers=kvserve_server.headers,
    ).json()["tokens"]
    text_out = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=4, temperature=0
    )
    batch = client.completions.create(
        model=MODEL, prompt=[ids, ids + [28]], max_tokens=4, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == text_out.choices[0].text
    assert batch.usage is not None and batch.usage.prompt_tokens == 2 * len(ids) + 1
    detok = httpx.post(
        kvserve_server.base_url + "/detokenize",
        json={"tokens": ids},
        headers=kvserve_server.headers,
    ).json()
    assert detok == {"prompt": "The sky is"}


def test_cached_tokens_and_cache_salt(client: openai.OpenAI) -> None:
    # A unique long prefix (> 10 blocks of 16 tokens) so no earlier test cached it.
    prefix = f"Session {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy dog. " * 20

    def cached(prompt: str, salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        assert out.usage.prompt_tokens > 160
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached(prefix + "Question one?", None) == 0
    assert cached(prefix + "Question two?", None) >= 160  # shares the prefix's full blocks
    assert cached(prefix + "Question two?", "tenant-b") == 0  # another tenant sees nothing
    assert cached(prefix + "Question three?", "tenant-b") >= 160  # but its own prefix
    assert cached(prefix + "Question three?", "tenant-c") == 0


def test_32_concurrent_streams_interleave_and_free_blocks(kvserve_server: ServerProcess) -> None:
    async def run() -> list[tuple[float, float, int, str | None]]:
        aclient = openai.AsyncOpenAI(
            base_url=kvserve_server.base_url + "/v1", api_key=kvserve_server.api_key, max_retries=0
        )

        async def one(i: int) -> tuple[float, float, int, str | None]:
            stream = await aclient.completions.create(
                model=MODEL,
                prompt=f"Client {i} says: the number {i} is",
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            first = last = 0.0
            tokens, finish = 0, None
            async for chunk in stream:
                now = time.monotonic()
                if chunk.choices and chunk.choices[0].text:
                    first = first or now
                    last = now
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return first, last, tokens, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    before = scrape(kvserve_server.base_url)
    results = asyncio.run(run())
    assert all(r[2] == 8 and r[3] == "length" for r in results), results
    # Interleaved: many streams were between their first and last token at once.
    events = sorted([(r[0], 1) for r in results] + [(r[1], -1) for r in results])
    in_progress = peak = 0
    for _, step in events:
        in_progress += step
        peak = max(peak, in_progress)
    assert peak >= 4, f"streams did not overlap (peak {peak}); continuous batching broken?"
    assert wait_for_metric(kvserve_server.base_url, "kvserve:num_active_blocks", 0.0) == 0.0
    after = scrape(kvserve_server.base_url)
    assert after["kvserve:num_requests_running"] == 0
    assert (
        after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"]
        >= 32 * 8
    )
    done = "kvserve:request_success_total{finished_reason=length}"
    assert after[done] - before.get(done, 0.0) >= 32


def test_metrics_parse_and_counters_move(
    kvserve_server: ServerProcess, client: openai.OpenAI
) -> None:
    before = scrape(kvserve_server.base_url)
    for name in (
        "kvserve:num_requests_running",
        "kvserve:num_requests_waiting",
        "kvserve:kv_cache_usage_perc",
        "kvserve:num_active_blocks",
        "kvserve:num_reclaimable_blocks",
        "kvserve:num_empty_blocks",
        "kvserve:prefix_cache_queries_total",
        "kvserve:prefix_cache_hits_total",
        "kvserve:num_preemptions_total",
        "kvserve:total_padding_tokens_total",
        "kvserve:prompt_tokens_total",
        "kvserve:generation_tokens_total",
        "kvserve:time_to_first_token_seconds_count",
        "kvserve:inter_token_latency_seconds_count",
        "kvserve:e2e_request_latency_seconds_count",
    ):
        assert name in before, name
    assert any(k.startswith("kvserve:scheduler_state{") for k in before)
    client.completions.create(
        model=MODEL, prompt="Metrics test prompt", max_tokens=4, extra_body={"ignore_eos": True}
    )
    after = scrape(kvserve_server.base_url)

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert moved("kvserve:prompt_tokens_total") >= 3
    assert moved("kvserve:generation_tokens_total") >= 4
    assert moved("kvserve:time_to_first_token_seconds_count") >= 1
    assert moved("kvserve:inter_token_latency_seconds_count") >= 3
    assert moved("kvserve:e2e_request_latency_seconds_count") >= 1
    assert moved("kvserve:prefix_cache_queries_total") >= 3
    # the step-time cost model (on by default) saw the steps it predicted
    assert after["kvserve:step_predicted_ms"] > 0 and after["kvserve:step_measured_ms"] > 0
    assert after["kvserve:step_time_abs_error"] >= 0


def test_disconnect_mid_stream_aborts_and_frees_blocks(kvserve_server: ServerProcess) -> None:
    url = kvserve_server.base_url
    before = scrape(url)
    body = {
        "prompt": "Tell me a very long story about a dragon.",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", url + "/v1/completions", json=body, headers=kvserve_server.headers
        ) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
        assert scrape(url)["kvserve:num_active_blocks"] > 0
    # the connection is closed: the server aborts the request and frees its blocks
    assert wait_for_metric(url, "kvserve:num_active_blocks", 0.0) == 0.0
    after = scrape(url)
    assert after["kvserve:num_requests_running"] == 0
    aborted = "kvserve:request_success_total{finished_reason=abort}"
    assert after[aborted] - before.get(aborted, 0.0) == 1
    assert (
        after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] < 1500
    )


def test_disconnect_while_waiting_non_stream_aborts(kvserve_server: ServerProcess) -> None:
    url = kvserve_server.base_url
    before = scrape(url)
    body = {"prompt": "Write an essay.", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, headers=kvserve_server.headers, timeout=2.0)
    assert wait_for_metric(url, "kvserve:num_active_blocks", 0.0) == 0.0
    after = scrape(url)
    aborted = "kvserve:request_success_total{finished_reason=abort}"
    assert after[aborted] - before.get(aborted, 0.0) == 1


def test_api_key_required_on_every_route_but_health(kvserve_server: ServerProcess) -> None:
    url = kvserve_server.base_url
    routes = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key-123"}):
            r = httpx.request(method, url + path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
        ok = httpx.request(
            method, url + path, json=body, headers=kvserve_server.headers, timeout=60
        )
        assert ok.status_code == 200, (path, ok.text)
    # only health stays open; /metrics needs the key too (issue 43)
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers=kvserve_server.headers).status_code == 200
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
