"""Bad input against the real server: status code, OpenAI error body, and a message that
says what to change. None of these may disturb the engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from support.server_helpers import ServerProcess, scrape

pytestmark = pytest.mark.model

CHAT = [{"role": "user", "content": "Hi"}]
LONG = "hello " * 2100  # > max_model_len=2048 tokens of the test server

# (route, body, status, param, words the message must contain)
CASES: list[tuple[str, Any, int, str | None, list[str]]] = [
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt", ["empty"]),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, 400, "prompt", ["empty", "at least one"]),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", ["missing", "prompt"]),
    ("/v1/completions", {"prompt": 123}, 400, "prompt", ["string", "token ids"]),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt", ["string", "token ids"]),
    ("/v1/completions", {"prompt": [999999]}, 400, "prompt", ["out of range", "[0, 49152)"]),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt", ["max_model_len", "shorten"]),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2048},
        400,
        "max_tokens",
        ["max_model_len=2048", "at most 2047"],
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 10**12},
        400,
        "max_tokens",
        ["at most"],
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": "5"},
        400,
        "max_tokens",
        ["integer", '"max_tokens": 16'],
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5.5}, 400, "max_tokens", ["integer"]),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": -1},
        400,
        "max_tokens",
        ["positive integer"],
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ["positive integer"]),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", [">= 0"]),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", ["number"]),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p", ["(0, 1]"]),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k", ["positive integer"]),
    ("/v1/completions", {"prompt": "hi", "top_k": "many"}, 400, "top_k", ["integer"]),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p", ["[0, 1]"]),
    (
        "/v1/completions",
        {"prompt": "hi", "presence_penalty": 9},
        400,
        "presence_penalty",
        ["[-2, 2]"],
    ),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", ["from 1 to"]),
    ("/v1/completions", {"prompt": "hi", "n": 600}, 400, "n", ["from 1 to"]),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of", [">= n"]),
    (
        "/v1/completions",
        {"prompt": "hi", "best_of": 3, "stream": True},
        400,
        "best_of",
        ["cannot be streamed"],
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 0, "echo": False},
        400,
        "max_tokens",
        ["echo"],
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "prompt_logprobs": 21},
        400,
        "prompt_logprobs",
        ["0 to 20"],
    ),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs", ["0 to 20"]),
    ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, 400, "stop", ["list of strings"]),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop", ["non-empty"]),
    ("/v1/completions", {"prompt": "hi", "seed": "abc"}, 400, "seed", ["integer"]),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos", ["boolean"]),
    ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt", ["non-empty"]),
    ("/v1/completions", {"prompt": "hi", "cache_salt": 5}, 400, "cache_salt", ["string"]),
    (
        "/v1/completions",
        {"prompt": "hi", "min_tokens": 9, "max_tokens": 4},
        400,
        "min_tokens",
        ["max_tokens=4"],
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        ['"stream": true'],
    ),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 5}}, 400, "logit_bias", ["token id"]),
    (
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"1": 500}},
        400,
        "logit_bias",
        ["[-100, 100]"],
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"99999": 1}},
        400,
        "logit_bias",
        ["[0, 49152)"],
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
        },
        400,
        "response_format.json_schema.schema",
        ["invalid", "JSON schema"],
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema.schema",
        ["needs json_schema.schema"],
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "structured_outputs": {"regex": "a(b"}},
        400,
        "structured_outputs.regex",
        ["unclosed group"],
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        400,
        "structured_outputs",
        ["exactly one"],
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "response_format": {"type": "xml"}},
        400,
        "response_format.type",
        ["json_schema"],
    ),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", ["at least one message"]),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", ["list"]),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
        ["'user'"],
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content",
        ["images"],
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "top_logprobs": 2},
        400,
        "top_logprobs",
        ['"logprobs": true'],
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        ["0 to 20"],
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": 5000},
        400,
        "max_completion_tokens",
        ["at most"],
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
        ["shorten"],
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [{"type": "function"}]},
        400,
        "tools[0]",
        ["not a function tool", "get_weather"],
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "model": "gpt-4"},
        404,
        "model",
        ["smollm2-135m-instruct"],
    ),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model", ["/v1/models"]),
    ("/tokenize", {}, 400, "prompt", ["exactly one"]),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", ["out of range"]),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", ["list"]),
]


@pytest.mark.parametrize(("route", "body", "status", "param", "words"), CASES)
def test_bad_input(
    kvserve_server: ServerProcess,
    route: str,
    body: Any,
    status: int,
    param: str | None,
    words: list[str],
) -> None:
    r = httpx.post(kvserve_server.base_url + route, json=body, headers=kvserve_server.headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    for word in words:
        assert word in err["message"], (word, err["message"])


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"{not json", ["not valid JSON"]),
        (b"", ["not valid JSON"]),
        (b"[1, 2]", ["JSON object"]),
        (b'"text"', ["JSON object"]),
    ],
)
def test_malformed_json(kvserve_server: ServerProcess, raw: bytes, words: list[str]) -> None:
    headers = {**kvserve_server.headers, "Content-Type": "application/json"}
    for route in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(kvserve_server.base_url + route, content=raw, headers=headers)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "invalid_json"
        assert all(w in err["message"] for w in words)


def test_unknown_route_and_method(kvserve_server: ServerProcess) -> None:
    r = httpx.get(kvserve_server.base_url + "/v1/engines", headers=kvserve_server.headers)
    assert r.status_code == 404 and "/v1/completions" in r.json()["error"]["message"]
    r = httpx.get(kvserve_server.base_url + "/v1/completions", headers=kvserve_server.headers)
    assert r.status_code == 405 and "error" in r.json()


def test_unknown_fields_are_ignored(kvserve_server: ServerProcess) -> None:
    body = {"prompt": "Hello there", "max_tokens": 1, "some_future_field": {"x": 1}, "user": "u1"}
    r = httpx.post(
        kvserve_server.base_url + "/v1/completions", json=body, headers=kvserve_server.headers
    )
    assert r.status_code == 200, r.text


def test_bad_requests_leave_the_engine_serving(kvserve_server: ServerProcess) -> None:
    url = kvserve_server.base_url
    for _, body, *_ in CASES[:8]:
        httpx.post(url + "/v1/completions", json=body, headers=kvserve_server.headers)
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": "Still alive?", "max_tokens": 2},
        headers=kvserve_server.headers,
        timeout=60,
    )
    assert r.status_code == 200
    stats = scrape(url)
    assert stats["kvserve:num_active_blocks"] == 0
    assert stats["kvserve:num_requests_waiting"] == 0
