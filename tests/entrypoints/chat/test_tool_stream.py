"""Streamed tool calls accumulate, as the ``openai`` client accumulates them, into
the calls the whole text gives: every call's arguments one JSON value under its own
index (issue 41: two calls' argument deltas under one index, or one call's sent
twice, made ``json.loads`` fail with "Extra data"). Without a model: varied tools,
key orders, nested ``name`` / ``parameters`` keys, 1-3 calls, outputs cut by the
budget, and every way of splitting the text into deltas."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from kvserve.entrypoints.chat.tool_parsers.base import ToolDelta, json_value_end
from kvserve.entrypoints.chat.tool_stream import ToolCallStream
from kvserve.entrypoints.chat.tools import ToolOutput, plan_tools

NAMES = ["get_weather", "name", "parameters", "arguments", "search.web-2"]
TOOLS = [{"type": "function", "function": {"name": n}} for n in NAMES]
KEYS = ["name", "parameters", "arguments", "city", "q", 'k"', "b\\"]
STRINGS = ["", "Paris", "}", "{", "]", '"', "\\", '"name": "x"', '"parameters": {', ", ", "é"]


def _value(r: random.Random, depth: int) -> Any:
    t = r.random()
    if depth > 2 or t < 0.35:
        return "".join(r.choice(STRINGS) for _ in range(r.randint(0, 3)))
    if t < 0.5:
        return r.choice([0, 17, -3, 1.5, True, False, None])
    if t < 0.7:
        return [_value(r, depth + 1) for _ in range(r.randint(0, 3))]
    return {r.choice(KEYS): _value(r, depth + 1) for _ in range(r.randint(0, 3))}


def _output(r: random.Random, fmt: str) -> tuple[str, list[tuple[str, Any]]]:
    """A model output in ``fmt`` and the calls it holds (name, arguments)."""
    calls = [
        (r.choice(NAMES), {r.choice(KEYS): _value(r, 1) for _ in range(r.randint(0, 3))})
        for _ in range(r.randint(1, 3))
    ]
    seps = r.choice([(",", ":"), (", ", ": ")])
    key = "parameters" if fmt == "required" else r.choice(["parameters", "arguments"])
    objs = []
    for name, args in calls:
        members = [("name", name), (key, args)]
        if fmt != "required" and r.random() < 0.3:
            members.reverse()  # free text: any key order
        objs.append(json.dumps(dict(members), separators=seps, ensure_ascii=r.random() < 0.5))
    if fmt == "required":
        return "[" + r.choice([",", ", ", ",\n"]).join(objs) + "]", calls
    if fmt == "llama3_json":
        return r.choice(["", "<|python_tag|>"]) + "; ".join(objs), calls
    return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs), calls


def _pieces(r: random.Random, text: str) -> list[str]:
    cuts = sorted(r.sample(range(1, len(text)), r.randint(0, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _stream(out: ToolOutput, pieces: list[str]) -> list[dict[str, Any]]:
    deltas = [out.chunk_delta(0, p, k == len(pieces) - 1) for k, p in enumerate(pieces)]
    return [d for d in deltas if d]


def _by_index(deltas: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A client's own accumulation: by ``index``, concatenating the arguments."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        indices = [tc["index"] for tc in d.get("tool_calls", [])]
        assert len(indices) == len(set(indices)), d  # one entry per call per chunk
        for tc in d.get("tool_calls", []):
            fn = tc["function"]
            if tc["index"] not in calls:
                assert tc["id"].startswith("call_") and tc["type"] == "function" and fn["name"]
                calls[tc["index"]] = [fn["name"], ""]
            else:
                assert "id" not in tc and "name" not in fn, tc  # the header goes once
            calls[tc["index"]][1] += fn.get("arguments") or ""
    assert sorted(calls) == list(range(len(calls)))  # dense, in order
    return [(n, a) for n, a in (calls[k] for k in sorted(calls))]


def _openai_helper(deltas: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The ``openai`` stream helper's accumulation (by list position)."""
    if not deltas:
        return []
    state = ChatCompletionStreamState()
    for k, d in enumerate(deltas):
        body = {"role": "assistant", "content": None, **d} if k == 0 else d
        state.handle_chunk(
            ChatCompletionChunk.model_validate(
                {
                    "id": "x",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": "m",
                    "choices": [{"index": 0, "delta": body, "finish_reason": None}],
                }
            )
        )
    message = state.current_completion_snapshot.choices[0].message
    return [(t.function.name, t.function.arguments) for t in message.tool_calls or []]


@pytest.mark.parametrize("fmt", ["required", "llama3_json", "hermes"])
def test_streamed_calls_accumulate_like_the_openai_client(fmt: str) -> None:
    parser = None if fmt == "required" else fmt
    plan = plan_tools(TOOLS, "required" if fmt == "required" else "auto", True,
                      tool_parser=parser, auto_enabled=True)  # fmt: skip
    for seed in range(250):
        r = random.Random(seed)
        text, calls = _output(r, fmt)
        cut = r.random() < 0.15  # cut by the budget: whatever it holds must still parse
        if cut:
            text = text[: r.randint(1, len(text))]
        whole = ToolOutput(plan, 1).message(0, text)[1]
        deltas = _stream(ToolOutput(plan, 1), _pieces(r, text))
        streamed = _by_index(deltas)
        assert _openai_helper(deltas) == streamed, (seed, text)
        if cut:  # a cut call may be unfinished, but never one value and more
            for _, arguments in streamed:
                end = json_value_end(arguments, 0)
                assert end is None or not arguments[end:].strip(), (seed, text, arguments)
            continue
        assert [(n, json.loads(a)) for n, a in streamed] == calls, (seed, text, streamed)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == streamed


def test_nested_name_and_arguments_keys_are_arguments() -> None:
    """Only the call object's own members name the call and start its arguments."""
    plan = plan_tools(TOOLS, "auto", True, tool_parser="llama3_json", auto_enabled=True)
    text = '{"parameters": {"name": "Paris", "x": {"arguments": 1}}, "name": "get_weather"}'
    deltas = _stream(ToolOutput(plan, 1), list(text))
    assert _by_index(deltas) == [("get_weather", '{"name": "Paris", "x": {"arguments": 1}}')]


def test_stream_keeps_one_value_per_index_whatever_the_parser_sends() -> None:
    """The wire rules hold even for a parser that repeats or misplaces pieces."""
    s = ToolCallStream()
    header = ToolDelta(index=0, id="call_a", name="f", arguments="")
    first = s.entries([header, ToolDelta(index=0, arguments='{"q": ""}')])
    assert first == [
        {
            "index": 0,
            "id": "call_a",
            "type": "function",
            "function": {"name": "f", "arguments": '{"q": ""}'},
        }
    ]
    # the same arguments again, and a header again: nothing goes out
    assert s.entries([ToolDelta(index=0, arguments='{"q": ""}'), header]) == []
    # a parser index that skips (2 after 0) is wire index 1; index 0 is then closed
    second = s.entries(
        [
            ToolDelta(index=2, id="call_b", name="g", arguments=""),
            ToolDelta(index=2, arguments='{"a": '),
            ToolDelta(index=0, arguments='{"late": 1}'),
        ]
    )
    assert [e["index"] for e in second] == [1]
    assert s.entries([ToolDelta(index=2, arguments='1} {"a": 1}')]) == [
        {"index": 1, "function": {"arguments": "1}"}}
    ]
    assert [s.arguments(i) for i in range(s.num_calls)] == ['{"q": ""}', '{"a": 1}']
    # arguments before any header are not sent
    assert ToolCallStream().entries([ToolDelta(index=0, arguments="{}")]) == []
