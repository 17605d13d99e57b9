"""``http_guard.parse_json_body``: lone surrogates are refused however they arrive,
including when the byte pre-check lets the per-string scan be skipped."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.http_guard import parse_json_body
from kvserve.entrypoints.openai_errors import APIError


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "a\\ud800b"}',
        b'{"prompt": "a\\uDFFFb"}',
        b'{"prompt": "a\\uDbFf"}',
        b'{"prompt": "a\xed\xa0\x80b"}',  # a surrogate's UTF-8 bytes (json: surrogatepass)
        b'{"k\xed\xb0\x80": 1}',
        '{"prompt": "a\\ud800"}'.encode("utf-16"),
        json.dumps({"prompt": "a\ud800"}).encode(),
    ],
)
def test_lone_surrogates_are_refused(raw: bytes) -> None:
    with pytest.raises(APIError) as e:
        parse_json_body(raw)
    assert e.value.status_code == 400 and "surrogate" in str(e.value)


def test_clean_bodies_parse_including_pairs_and_hangul() -> None:
    big = "hello world " * 100_000
    assert parse_json_body(json.dumps({"prompt": big}).encode())["prompt"] == big
    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00"}')["prompt"] == "\U0001f600"
    text = "\ud55c\uad6d\uc5b4 \U0001f600"  # Hangul (0xED lead bytes) and an emoji
    assert parse_json_body(json.dumps({"p": text}, ensure_ascii=False).encode())["p"] == text
