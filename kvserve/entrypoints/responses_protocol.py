"""``POST /v1/responses``' request model and its translation into a chat
completion request (``to_chat``): input items as chat messages, function tools as
chat tools, ``text.format`` as ``response_format``. Running it is ``responses``.

Input: ``input`` as a string (one user message) or a list of items: messages
(``{"role", "content"}``, content a string or ``input_text``/``output_text``
parts, with or without ``"type": "message"``), ``function_call`` items (the
model's earlier calls) and ``function_call_output`` items (their results);
``reasoning`` items are skipped. ``instructions`` become the system message.
``tools`` are function tools (``{"type": "function", "name", "parameters"}``);
``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``,
``top_p`` and ``text.format`` (``json_schema`` / ``json_object``) map onto the chat
fields of the same meaning, so function calling behaves exactly as on chat
completions (``docs/function-calling.md``).

``previous_response_id`` is refused (400): kvserve stores no responses (it would
be lost on restart and is not shared between replicas), so a client sends the
whole conversation in ``input``. ``store`` is accepted and answered ``false``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, ValidationError, WithJsonSchema, field_validator

from kvserve.entrypoints.chat_protocol import ChatCompletionRequest
from kvserve.entrypoints.openai_errors import bad_request, validation_error_to_api
from kvserve.entrypoints.openai_protocol import StrictModel

INPUT_EXAMPLE = '"input": [{"role": "user", "content": "Hello"}]'


_TEXT_CONTENT: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "text"],
                "properties": {
                    "type": {"enum": ["input_text", "output_text", "text"]},
                    "text": {"type": "string"},
                },
            },
        },
    ]
}
_INPUT_ITEM_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "type": {"const": "message"},
                "role": {"enum": ["user", "assistant", "system", "developer"]},
                "content": _TEXT_CONTENT,
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "name", "arguments"],
            "properties": {
                "type": {"const": "function_call"},
                "call_id": {"type": "string"},
                "name": {"type": "string"},
                "arguments": {"type": "string"},
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "output"],
            "properties": {
                "type": {"const": "function_call_output"},
                "call_id": {"type": "string"},
                "output": {"type": "string"},
            },
        },
    ]
}
RESPONSES_TOOLS_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"const": "function"},
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                    "description": {"type": "string"},
                    "parameters": {
                        "type": "object",
                        "properties": {"type": {"const": "object"}},
                    },
                    "strict": {"type": "boolean"},
                },
            },
        },
        {"type": "null"},
    ]
}


class ResponsesRequest(StrictModel):
    """POST /v1/responses (the fields kvserve reads; others are listed in the
    ``x-kvserve-ignored-fields`` header)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: Annotated[
        str | list[Any],
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": _INPUT_ITEM_SCHEMA},
                ]
            }
        ),
    ]
    instructions: str | None = None
    tools: Annotated[Any, WithJsonSchema(RESPONSES_TOOLS_SCHEMA)] = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, json_schema_extra={"minimum": 1})
    temperature: float | None = Field(default=None, json_schema_extra={"minimum": 0})
    top_p: float | None = Field(
        default=None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1}
    )
    stream: bool = False
    # Refused when set (nothing is stored): the schema says null only.
    previous_response_id: Annotated[Any, WithJsonSchema({"type": "null"})] = None
    store: bool | None = None
    text: dict[str, Any] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # as chat completions
    metadata: dict[str, Any] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, list):
            raise ValueError('use a list of {"type": "function", "name": ...} tools')
        return value


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                isinstance(part, dict)
                and part.get("type") in ("input_text", "output_text", "text")
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
                continue
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"{where}.content[{j}] is of type {kind!r}: this server reads only text parts "
                '({"type": "input_text", "text": "..."}); images, audio and files are not '
                "supported",
                param=f"{where}.content[{j}]",
            )
        return "".join(texts)
    raise bad_request(
        f"{where}.content must be a string or a list of input_text parts; for example "
        + INPUT_EXAMPLE,
        param=f"{where}.content",
    )


def _require_strings(item: dict[str, Any], where: str, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(item.get(name), str):
            raise bad_request(
                f"{where}.{name} must be a string (a {item.get('type')} item has "
                f"{', '.join(names)})",
                param=f"{where}.{name}",
            )


def to_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of a responses request (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(
                f"{where} must be an object; for example " + INPUT_EXAMPLE, param=where
            )
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(
                    f"{where}.role is {role!r}: use user, assistant, system or developer",
                    param=f"{where}.role",
                )
            if "content" not in item:
                raise bad_request(
                    f"{where} has no content: a message item needs role and content; for "
                    "example " + INPUT_EXAMPLE,
                    param=f"{where}.content",
                )
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            _require_strings(item, where, ("call_id", "name", "arguments"))
            call = {
                "id": str(item.get("call_id") or item.get("id") or ""),
                "type": "function",
                "function": {
                    "name": str(item.get("name", "")),
                    "arguments": str(item.get("arguments") or "{}"),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _require_strings(item, where, ("call_id",))
            if not isinstance(item.get("output"), str | list):
                raise bad_request(
                    f"{where}.output must be the tool's result as a string", param=f"{where}.output"
                )
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text}
            )
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(
                f"{where} is of type {kind!r}: this server reads message, function_call, "
                "function_call_output (and skips reasoning) items",
                param=f"{where}.type",
            )
    if not messages:
        raise bad_request("input is empty: send at least one message; " + INPUT_EXAMPLE, "input")
    return messages


def _chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise bad_request(
                f"tools[{i}] is of type {kind!r}: this server runs function tools only "
                '({"type": "function", "name": "get_weather", "parameters": {...}})',
                param=f"tools[{i}]",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema")},
        }
    return {"type": fmt.get("type")}


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves ``req``; APIError(400) for what
    kvserve cannot do."""
    if req.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: this server stores no responses; send the "
            "whole conversation in input (earlier messages, function_call and "
            "function_call_output items)",
            param="previous_response_id",
        )
    body: dict[str, Any] = {"messages": to_messages(req), "stream": req.stream}
    if req.model is not None:
        body["model"] = req.model
    for name in ("temperature", "top_p", "seed", "parallel_tool_calls"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    tools = _chat_tools(req.tools)
    if tools:
        body["tools"] = tools
    if req.tool_choice is not None and tools:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    rf = _response_format(req.text)
    if rf is not None:
        body["response_format"] = rf
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error_to_api(e) from None
