"""Tool-call parsers: whole-text extraction and streaming, for every split of the text."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.entrypoints.chat.tool_parsers import TOOL_PARSERS, ToolDelta, get_tool_parser
from kvserve.entrypoints.chat.tools import NamedCallParser, RequiredCallsParser


def stream(parser_cls, text: str, seed: int):
    """Feed ``text`` in random pieces; return (content, calls as (name, arguments))."""
    rng = random.Random(seed)
    parser = parser_cls()
    deltas: list[ToolDelta] = []
    i = 0
    while i < len(text):
        k = rng.randint(1, 7)
        deltas += parser.feed(text[i : i + k])
        i += k
    deltas += parser.finish()
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, list[str]] = {}
    ids: dict[int, str] = {}
    for d in deltas:
        if d.index is None:
            continue
        if d.id is not None:
            assert d.index not in calls, "a call's id and name come once, first"
            assert d.name and d.arguments == ""
            calls[d.index] = [d.name, ""]
            ids[d.index] = d.id
        else:
            assert d.index in calls, "argument fragments follow the call's first delta"
            calls[d.index][1] += d.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)]


HERMES = [
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        "Let me check.",
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        '<tool_call>{"name": "a", "arguments": {"x": "}</tool_call>{", "y": [1, {"z": 2}]}}'
        '</tool_call>\n<tool_call>{"arguments": {}, "name": "b"}</tool_call>',
        None,
        [("a", '{"x": "}</tool_call>{", "y": [1, {"z": 2}]}'), ("b", "{}")],
    ),
    ("No tools needed: 1 < 2 and <b>bold</b>.", "No tools needed: 1 < 2 and <b>bold</b>.", []),
    (
        '<tool_call>{"name": "q", "arguments": "{\\"k\\": 1}"}</tool_call>',
        None,
        [("q", '{"k": 1}')],
    ),
]


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes_whole_and_streamed(text: str, content: str | None, calls: list) -> None:
    parser = get_tool_parser("hermes")
    found = parser().extract(text)
    assert found.content == content
    assert [(c.name, c.arguments) for c in found.calls] == calls
    for c in found.calls:
        assert isinstance(json.loads(c.arguments), dict)
        assert c.id.startswith("call_")
    for seed in range(25):
        s_content, s_calls = stream(parser, text, seed)
        assert s_calls == calls
        assert (s_content.strip() or None) == content


def test_hermes_malformed_call_is_content() -> None:
    text = '<tool_call>{"name": "a", "arguments": {"x": </tool_call>'
    found = get_tool_parser("hermes")().extract(text)
    assert found.calls == []
    assert found.content is not None and "tool_call" in found.content


def test_hermes_unclosed_call_at_end_of_output() -> None:
    text = '<tool_call>\n{"name": "a", "arguments": {"x": 1}}'
    found = get_tool_parser("hermes")().extract(text)
    assert [(c.name, c.arguments) for c in found.calls] == [("a", '{"x": 1}')]


LLAMA = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "arguments": {}}',
        None,
        [("a", '{"n": 1}'), ("b", "{}")],
    ),
    ("The answer is {not json}.", "The answer is {not json}.", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA)
def test_llama3_json(text: str, content: str | None, calls: list) -> None:
    parser = get_tool_parser("llama3_json")
    found = parser().extract(text)
    assert found.content == content
    assert [(c.name, c.arguments) for c in found.calls] == calls
    for seed in range(25):
        _, s_calls = stream(parser, text, seed)
        assert s_calls == calls


PYTHONIC = [
    (
        '[get_weather(city="Paris", unit="celsius"), get_time(tz=\'UTC\', n=[1, (2)])]',
        [
            ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
            ("get_time", '{"tz": "UTC", "n": [1, 2]}'),
        ],
    ),
    ('[f(s="a)b]c", d={"k": None})]', [("f", '{"s": "a)b]c", "d": {"k": null}}')]),
    ("[1, 2, 3] are numbers", []),
]


@pytest.mark.parametrize("text,calls", PYTHONIC)
def test_pythonic(text: str, calls: list) -> None:
    parser = get_tool_parser("pythonic")
    found = parser().extract(text)
    assert [(c.name, c.arguments) for c in found.calls] == calls
    if not calls:
        assert found.content == text
    for seed in range(25):
        content, s_calls = stream(parser, text, seed)
        assert s_calls == calls
        if not calls:
            assert content == text


def test_pythonic_positional_args_are_not_a_call() -> None:
    assert get_tool_parser("pythonic")().extract("[f(1, 2)]").calls == []


def test_required_array_and_named() -> None:
    text = '[{"name": "a", "parameters": {"x": [1, 2]}}, {"name": "b", "parameters": {}}]'
    found = RequiredCallsParser().extract(text)
    assert [(c.name, c.arguments) for c in found.calls] == [("a", '{"x": [1, 2]}'), ("b", "{}")]
    for seed in range(10):
        _, calls = stream(RequiredCallsParser, text, seed)
        assert calls == [("a", '{"x": [1, 2]}'), ("b", "{}")]
    _, calls = stream(lambda: NamedCallParser("f"), '{"q": "x"}', 3)
    assert calls == [("f", '{"q": "x"}')]


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "pythonic"}
