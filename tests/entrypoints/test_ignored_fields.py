"""The ignored-fields list names each field once (pydantic counts extras as set too,
so a known no-op sent as an extra was listed twice), for chat and the Responses API."""

from __future__ import annotations

from kvserve.entrypoints.chat_protocol import ChatCompletionRequest
from kvserve.entrypoints.extras import ignored_fields, ignored_header
from kvserve.entrypoints.responses_protocol import ResponsesRequest


def test_each_ignored_field_named_once() -> None:
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "foo": 1,
            "user": "u",
            "metadata": {"a": "b"},
            "store": True,
        }
    )
    names = ignored_fields(chat)
    assert sorted(names) == ["foo", "metadata", "store", "user"] and len(set(names)) == len(names)
    resp = ResponsesRequest.model_validate(
        {"input": "hi", "reasoning": {}, "truncation": "auto", "user": "u", "store": True}
    )
    names = ignored_fields(resp)
    assert sorted(names) == ["reasoning", "store", "truncation", "user"]
    assert ignored_header(names)["x-kvserve-ignored-fields"].count("user") == 1
