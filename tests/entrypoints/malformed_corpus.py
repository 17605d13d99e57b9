"""A corpus of malformed, hostile or absurd requests (``CASES``): each must be answered
with a 4xx in OpenAI's error shape, never a 5xx, and leave nothing running, waiting
or holding KV blocks. ``test_malformed_corpus.py`` replays it.

Each case is ``(name, method, path, headers, body bytes)``. Built from a few
families - broken JSON, nesting, text that is not Unicode, ids outside the
vocabulary, wrong types and absurd numbers on every field, wrong content types,
template takeovers - crossed with the JSON routes.
"""

from __future__ import annotations

import json
from typing import Any

JSON = {"Content-Type": "application/json"}
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
VOCAB = 49152
CHAT = [{"role": "user", "content": "Hi"}]

Case = tuple[str, str, str, dict[str, str], bytes]


def _j(value: Any) -> bytes:
    return json.dumps(value).encode()


def _cases() -> list[Case]:
    out: list[Case] = []

    def add(name: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        out.append((name, "POST", path, JSON if headers is None else headers, body))

    # broken JSON and non-object bodies, on every JSON route
    for path in ROUTES:
        for name, raw in (
            ("truncated", b'{"prompt": "hi"'),
            ("garbage", b"\x00\x01\x02"),
            ("trailing", b'{"prompt": "hi"} x'),
            ("bad-utf8", b'{"prompt": "\xff\xfe"}'),
            ("array", b"[1, 2]"),
            ("null", b"null"),
            ("empty", b""),
            ("nan-body", b"NaN"),
            ("deep-array", b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
            ("deep-object", b'{"x": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}"),
            ("deep-unclosed", b"[" * 20000),
            ("surrogate-key", b'{"\\ud800": 1, "prompt": "hi"}'),
        ):
            add(f"{path}:{name}", path, raw)
    # text that is not Unicode (lone surrogates) wherever text goes
    for path, body in (
        ("/v1/completions", {"prompt": "a\ud800b"}),
        ("/v1/completions", {"prompt": ["ok", "\udc00"]}),
        ("/v1/completions", {"prompt": "hi", "stop": "\ud800"}),
        ("/v1/completions", {"prompt": "hi", "user": "\ud800"}),
        ("/v1/completions", {"prompt": "hi", "cache_salt": "\udfff"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]},
        ),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"x": "\ud800"}}),
        ("/tokenize", {"prompt": "\ud800"}),
        ("/tokenize", {"messages": [{"role": "user", "content": "\udbff"}]}),
    ):
        add(f"surrogate:{path}:{sorted(body)}", path, json.dumps(body).encode())
    # token ids outside the vocabulary, or not ids at all
    for path, body in (
        ("/v1/completions", {"prompt": [VOCAB]}),
        ("/v1/completions", {"prompt": [-1]}),
        ("/v1/completions", {"prompt": [[1, 2], [10**12]]}),
        ("/v1/completions", {"prompt": [1.5]}),
        ("/v1/completions", {"prompt": [True]}),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [VOCAB]}),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-3]}),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {str(VOCAB): 1}}),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 1}}),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1e308}}),
        ("/v1/chat/completions", {"messages": CHAT, "stop_token_ids": [10**20]}),
        ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"99999999": 1}}),
        ("/detokenize", {"tokens": [VOCAB]}),
        ("/detokenize", {"tokens": [-1]}),
        ("/detokenize", {"tokens": [10**30]}),
        ("/detokenize", {"tokens": "1 2 3"}),
    ):
        add(f"ids:{path}:{json.dumps(body)[:60]}", path, _j(body))
    # wrong types and out-of-range numbers on the sampling fields
    out_of_range: dict[str, list[Any]] = {
        "max_tokens": [-1, 10**30, 1e308],
        "n": [0, -1, 10**30],
        "best_of": [0, 10**30],
        "temperature": [-1, -1e308],
        "top_p": [0, 2, -1e308],
        "top_k": [-2, -(10**30)],
        "logprobs": [-1, 21, 10**30],
        "seed": [2**64, -(2**63) - 1, 1e308],
        "min_tokens": [-1, 10**30],
        "prompt_logprobs": [-1, 21],
        "presence_penalty": [3, -1e308],
        "repetition_penalty": [0, -1],
    }
    for field, values in out_of_range.items():
        for value in [*values, "5", [], {}, True]:
            add(f"field:{field}={value!r}", "/v1/completions", _j({"prompt": "hi", field: value}))
    for raw in (
        b'{"prompt": "hi", "temperature": NaN}',
        b'{"prompt": "hi", "top_p": Infinity}',
        b'{"prompt": "hi", "max_tokens": 1e400}',
        b'{"prompt": "hi", "seed": 1e30}',
    ):
        add(f"number:{raw.decode()}", "/v1/completions", raw)
    for body in (
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        {"messages": CHAT, "max_completion_tokens": 10**12},
        {"messages": CHAT, "top_logprobs": 50, "logprobs": True},
        {"messages": CHAT, "stream_options": {"include_usage": True}},
        {"messages": CHAT, "chat_template_kwargs": {"messages": []}},
        {"messages": CHAT, "chat_template_kwargs": {"x": "<|im_start|>system"}},
        {"messages": CHAT, "chat_template_kwargs": "x"},
        {"messages": CHAT, "structured_outputs": {"regex": "("}},
        {"messages": CHAT, "tools": [{"type": "function"}]},
    ):
        add(f"chat:{json.dumps(body)[:70]}", "/v1/chat/completions", _j(body))
    # template takeovers (refused: the server does not trust request templates)
    for path in ("/v1/chat/completions", "/tokenize"):
        add(f"template:{path}", path, _j({"messages": CHAT, "chat_template": "{{ 'X' }}"}))
        add(
            f"template-kw:{path}",
            path,
            _j({"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
        )
    # tokenize shapes
    for body in ({}, {"prompt": "a", "messages": CHAT}, {"prompt": 5}, {"messages": []}):
        add(f"tokenize:{body}", "/tokenize", _j(body))
    # content types (a browser's cross-site "simple" requests) and sizes
    body = _j({"prompt": "hi", "max_tokens": 1})
    for ctype in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=a",
        "text/html",
        "application/xml",
        "",
    ):
        headers = {"Content-Type": ctype} if ctype else {}
        for path in ROUTES:
            add(f"ctype:{ctype or 'none'}:{path}", path, body, headers)
    add("too-large", "/v1/completions", _j({"prompt": "x" * 300_000}))
    add("content-length-lie", "/v1/completions", body, {**JSON, "Content-Length": "99999999999"})
    return out


CASES: list[Case] = _cases()
