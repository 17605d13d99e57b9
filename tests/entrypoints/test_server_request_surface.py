"""n / best_of, response_format and structured_outputs, echo and prompt logprobs,
logit_bias: the real ``kvserve serve`` on the default model, driven by the official
``openai`` client, streamed and not."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.server_helpers import ServerProcess, scrape, wait_for_metric

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
PERSON = {
    "type": "object",
    # bounded, so the grammar ends well within max_tokens (a cut output cannot parse)
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(kvserve_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=kvserve_server.base_url + "/v1", api_key=kvserve_server.api_key, max_retries=0
    )


def _check_person(text: str) -> None:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise AssertionError(f"not JSON: {text!r}") from e
    assert set(data) == {"name", "age"}
    assert isinstance(data["name"], str) and isinstance(data["age"], int)


def test_completions_n_and_usage(client: openai.OpenAI) -> None:
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    many = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=4, n=3
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({c.text for c in many.choices}) > 1
    assert many.usage is not None and one.usage is not None
    assert many.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert many.usage.completion_tokens == 18
    best = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=4, n=2, best_of=4
    )
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage is not None and best.usage.completion_tokens == 16  # all 4 generated


def test_streamed_choices_carry_their_index(client: openai.OpenAI) -> None:
    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=9, n=2, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert set(texts) == finished == {0, 1}
    chat_indexes = set()
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=4,
        n=3,
        stream=True,
    ):
        chat_indexes |= {c.index for c in chunk.choices}
    assert chat_indexes == {0, 1, 2}


def test_response_format_json_schema_and_json_object(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    full = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        response_format=fmt,
        max_tokens=200,
        n=2,
        temperature=0.7,
        seed=4,
    )
    for choice in full.choices:
        assert choice.finish_reason == "stop"
        _check_person(choice.message.content or "")
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format=fmt,
            max_tokens=200,
            stream=True,
            seed=5,
            temperature=0.7,
        )
        if c.choices
    )
    _check_person(streamed)
    obj = client.completions.create(
        model=MODEL,
        prompt="A JSON object describing a cat:",
        max_tokens=300,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    # any object is unbounded: it parses when it ended by itself (max_tokens cuts anything)
    text = obj.choices[0].text
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")
    bounded = client.completions.create(
        model=MODEL,
        prompt="A person as JSON:",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    assert bounded.choices[0].finish_reason == "stop"
    _check_person(bounded.choices[0].text)


def test_vllm_structured_outputs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert out.choices[0].text in ("yes", "no")
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a date."}],
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )
    content = out.choices[0].message.content or ""
    assert len(content) == 10 and content[4] == "-" and content[:2] == "20"


def test_echo_logprobs_legacy_shape(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert out.usage is not None
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3
    assert "".join(lp.tokens[:n_prompt]) == PROMPT
    assert (
        lp.token_logprobs[0] is None and lp.top_logprobs is not None and lp.top_logprobs[0] is None
    )
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset is not None and lp.text_offset[:2] == [0, len(lp.tokens[0])]

    score = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0
    )
    assert score.choices[0].text == PROMPT
    assert score.usage is not None and score.usage.completion_tokens == 0
    assert score.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n_prompt]  # type: ignore[union-attr]

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            echo=True,
            logprobs=2,
            stream=True,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.token_logprobs
    ]  # type: ignore[union-attr]
    assert streamed[0] is None and len(streamed) == n_prompt + 3


def test_prompt_logprobs_and_logit_bias(
    kvserve_server: ServerProcess, client: openai.OpenAI
) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "prompt_logprobs": 1,
    }
    r = httpx.post(
        kvserve_server.base_url + "/v1/chat/completions", json=body, headers=kvserve_server.headers
    )
    plp = r.json()["prompt_logprobs"]
    assert (
        r.status_code == 200 and plp[0] is None and len(plp) == r.json()["usage"]["prompt_tokens"]
    )
    assert all(
        any(v["rank"] == 1 for v in entry.values())
        and all(v["logprob"] <= 0 for v in entry.values())
        for entry in plp[1:]
    )
    r = httpx.post(
        kvserve_server.base_url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0, "n": 2},
        headers=kvserve_server.headers,
    )
    choices = r.json()["choices"]
    assert [len(c["prompt_logprobs"]) for c in choices] == [r.json()["usage"]["prompt_tokens"]] * 2
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]  # one prompt, scored once
    tokens = httpx.post(
        kvserve_server.base_url + "/tokenize",
        json={"prompt": " banana", "add_special_tokens": False},
        headers=kvserve_server.headers,
    ).json()["tokens"]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logit_bias={str(tokens[0]): 100}
    )
    assert out.choices[0].text == " banana banana"


def test_disconnect_frees_every_sample(kvserve_server: ServerProcess) -> None:
    url = kvserve_server.base_url
    body = {
        "prompt": "Tell me a long story.",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
        "n": 8,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", url + "/v1/completions", json=body, headers=kvserve_server.headers
        ) as r,
    ):
        lines = r.iter_lines()  # kept: a dropped iterator closes the response
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 16:
                break
        assert scrape(url)["kvserve:num_requests_running"] == 8
    assert wait_for_metric(url, "kvserve:num_active_blocks", 0.0) == 0.0
    assert scrape(url)["kvserve:num_requests_running"] == 0
