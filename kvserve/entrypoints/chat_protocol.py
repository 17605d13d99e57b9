"""Chat request models: POST /v1/chat/completions (messages, tools, logprobs) and
the tokenize/detokenize requests that carry the same messages."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator

from kvserve.entrypoints.openai_errors import EXAMPLES, bad_request
from kvserve.entrypoints.openai_protocol import (
    MAX_LOGPROBS,
    SamplingRequest,
    StrictModel,
    sampling_model_config,
    schema_present,
)

_CONTENT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                "required": ["type", "text"],
            },
        },
        {"type": "null"},
    ]
}


_FUNCTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
        "description": {"type": "string"},
        "parameters": {"type": "object", "properties": {"type": {"const": "object"}}},
        "strict": {"type": "boolean"},
    },
}
_TOOLS_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "function"],
                "properties": {"type": {"const": "function"}, "function": _FUNCTION_SCHEMA},
            },
        },
        {"type": "null"},
    ]
}


class ToolCallFunction(StrictModel):
    name: str
    arguments: str = "{}"


class AssistantToolCall(StrictModel):
    """One entry of an assistant message's ``tool_calls`` in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def as_template_dict(self) -> dict[str, Any]:
        try:
            args: Any = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": args},
        }


def _check_content(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                break
            texts.append(part["text"])
        else:
            return "".join(texts)
    raise ValueError(
        'use a string or a list of {"type": "text", "text": "..."} parts '
        "(images and audio are not supported)"
    )


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Any, WithJsonSchema(_CONTENT_SCHEMA)] = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        return _check_content(value)

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: ``developer`` becomes ``system``;
        an assistant's ``tool_calls`` keep OpenAI's shape with ``arguments`` parsed
        into a dict (templates render it with ``tojson``), a tool message keeps
        its ``tool_call_id``."""
        content = self.content
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.as_template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    model_config = sampling_model_config(
        {
            "if": schema_present("top_logprobs", {"type": "integer"}),
            "then": schema_present("logprobs", {"const": True}),
        }
    )

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = Field(default=None, json_schema_extra={"minimum": 1})
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, json_schema_extra={"minimum": 0, "maximum": 20})
    add_generation_prompt: bool = True
    # A request's own template: refused (400) unless --trust-request-chat-template.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[Any, WithJsonSchema(_TOOLS_SCHEMA)] = None
    tool_choice: Annotated[Any, WithJsonSchema({})] = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, list):
            raise ValueError('use a list of {"type": "function", "function": {...}} tools')
        return value

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise bad_request(
                "messages is empty: send at least one message; for example " + EXAMPLES["messages"],
                param="messages",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request(
                'top_logprobs needs "logprobs": true: set logprobs to true or drop top_logprobs',
                param="top_logprobs",
            )
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs={self.top_logprobs} is out of range: use an integer from 0 to "
                f"{MAX_LOGPROBS}; for example " + EXAMPLES["top_logprobs"],
                param="top_logprobs",
            )

    def param_names(self, max_tokens_param: str) -> dict[str, str]:
        return {
            "max_tokens": max_tokens_param,
            "prompt": "messages",
            "logprobs": "top_logprobs",
            **self._structured_names(),
        }

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(max_completion_tokens or max_tokens, the name of the field it came from)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(StrictModel):
    """POST /tokenize (vLLM's shape): either ``prompt`` or ``messages``."""

    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {
                    "required": ["prompt"],
                    "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}},
                },
                {
                    "required": ["messages"],
                    "properties": {
                        "messages": {"type": "array", "minItems": 1},
                        "prompt": {"type": "null"},
                    },
                },
            ]
        },
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    """POST /detokenize (vLLM's shape)."""

    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})
