"""The chat side of forced tool calls, without a model: the constraint asks to end
within max_tokens, a call closed on its budget says ``finish_reason: "length"``
(a call the model ended says ``"tool_calls"``), and a forced stream opens with
OpenAI's first chunk of a call (role, ``content: null`` and the call's header)."""

from __future__ import annotations

import json

from kvserve.engine.outputs import RequestDelta
from kvserve.entrypoints.chat.tools import ToolOutput, plan_tools
from kvserve.entrypoints.chat_protocol import ChatCompletionRequest
from kvserve.entrypoints.openai_render import ChatRenderer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _plan(choice: object):
    return plan_tools(TOOLS, choice, False, tool_parser="hermes", auto_enabled=True)


def test_forced_constraints_end_within_max_tokens() -> None:
    for choice in ("required", NAMED):
        forced = _plan(choice).structured()
        assert forced is not None and forced.within_max_tokens
    assert _plan("auto").structured() is None


def test_finish_reason_of_forced_and_auto_calls() -> None:
    out = ToolOutput(_plan(NAMED), 1, max_tokens=20)
    out.message(0, '{"city": "Paris"}')
    assert out.finish_reason(0, "stop", 12) == "tool_calls"  # the model ended it
    assert out.finish_reason(0, "stop", 20) == "length"  # closed on its budget
    assert out.finish_reason(0, "length", 20) == "length"
    unknown = ToolOutput(_plan(NAMED), 1, max_tokens=None)  # no limit known: as ended
    unknown.message(0, '{"city": "Paris"}')
    assert unknown.finish_reason(0, "stop", 20) == "tool_calls"
    auto = ToolOutput(_plan("auto"), 1, max_tokens=20)
    auto.message(0, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    assert auto.finish_reason(0, "stop", 20) == "tool_calls"  # not forced: the model's


def _renderer(choice: object) -> ChatRenderer:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "weather in Paris?"}],
            "tools": TOOLS,
            "tool_choice": choice,
            "max_tokens": 10,
            "stream": True,
        }
    )
    return ChatRenderer(req, None, [1, 2], ToolOutput(_plan(choice), 1, max_tokens=10))  # type: ignore[arg-type]


def test_forced_stream_opens_like_openai() -> None:
    r = _renderer(NAMED)
    assert r.opening_chunks(1) == []
    first = r.chunk(0, RequestDelta("x", [5], '{"ci', num_output_tokens=1))
    assert first is not None
    delta = first["delta"]
    assert delta["role"] == "assistant" and delta["content"] is None
    (header,) = delta["tool_calls"]
    assert header == {  # OpenAI's header: empty arguments, the text follows
        "index": 0,
        "id": header["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    later = r.chunk(0, RequestDelta("x", [6], 'ty": "Paris"}', num_output_tokens=2))
    assert later is not None and "role" not in later["delta"]
    (piece,) = later["delta"]["tool_calls"]
    assert piece == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    last = r.chunk(0, RequestDelta("x", [2], "", finish_reason="stop", num_output_tokens=3))
    assert last is not None and last["delta"] == {} and last["finish_reason"] == "tool_calls"
    assert json.loads(piece["function"]["arguments"]) == {"city": "Paris"}
    # auto keeps the role chunk first (the model may answer in text)
    auto = _renderer("auto")
    assert auto.opening_chunks(1)[0]["delta"] == {"role": "assistant", "content": ""}
