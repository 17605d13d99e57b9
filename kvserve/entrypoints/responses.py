"""``POST /v1/responses``: OpenAI's Responses API (the OpenAI Agents SDK's default),
served by translating each request into a chat completion on the same engine.

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

Output: a ``response`` object whose ``output`` holds one ``message`` item
(``output_text`` content) when the model wrote text and one ``function_call``
item per call. Streamed, the events are OpenAI's: ``response.created``,
``response.in_progress``, per item ``response.output_item.added``, text as
``response.content_part.added`` / ``response.output_text.delta`` /
``response.output_text.done`` / ``response.content_part.done``, calls as
``response.function_call_arguments.delta`` / ``.done``, then
``response.output_item.done``, and last ``response.completed`` with the whole
response; each carries ``sequence_number``.

``previous_response_id`` is refused (400): kvserve stores no responses (it would
be lost on restart and is not shared between replicas), so a client sends the
whole conversation in ``input``. ``store`` is accepted and answered ``false``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import ConfigDict, Field, ValidationError, WithJsonSchema, field_validator

from kvserve.entrypoints.openai_errors import APIError, bad_request, validation_error_to_api
from kvserve.entrypoints.openai_protocol import ChatCompletionRequest, _Strict
from kvserve.entrypoints.openai_serving import (
    Generation,
    OpenAIServing,
    _check_finish,
    abort_all,
    error_event,
    merge,
)

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


class ResponsesRequest(_Strict):
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
    seed: int | None = None
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


# ---------------------------------------------------------------------- running
@dataclass
class ResponseRun:
    """One responses request queued on the engine (as a chat completion)."""

    serving: OpenAIServing
    req: ResponsesRequest
    chat: ChatCompletionRequest
    gen: Generation
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    seq: int = 0

    def abort(self) -> None:
        abort_all(self.gen.streams)()

    def envelope(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        req = self.req
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.serving.served_model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "metadata": req.metadata or {},
        }

    @staticmethod
    def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]
            },
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"],
        }

    async def collect(self) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        choices = await self.serving.collect(self.gen)
        chat = self.serving.response(self.gen, choices)
        choice = chat["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        if message.get("content"):
            output.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"]))
        for call in message.get("tool_calls") or []:
            output.append(
                _call_item(
                    f"fc_{uuid.uuid4().hex}",
                    call["id"],
                    call["function"]["name"],
                    call["function"]["arguments"],
                )
            )
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self.envelope(status, output, self.usage(chat["usage"]))

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """The streamed response's events (module docstring)."""
        yield self._event("response.created", response=self.envelope("in_progress", [], None))
        yield self._event("response.in_progress", response=self.envelope("in_progress", [], None))
        renderer = self.gen.renderer
        choices = self.gen.new_choices()
        output: list[dict[str, Any]] = []
        text_item: dict[str, Any] | None = None
        calls: dict[int, dict[str, Any]] = {}  # tool call index -> its item
        finish: str | None = None
        try:
            async for i, delta in merge(self.gen.streams):
                _check_finish(delta)
                choices[i].add(delta)
                rendered = renderer.chunk(i, delta)
                if rendered is None:
                    continue
                body = rendered.get("delta", {})
                finish = rendered.get("finish_reason") or finish
                content = body.get("content")
                if content:
                    if text_item is None:
                        text_item = _message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
                        output.append(text_item)
                        index = len(output) - 1
                        yield self._event(
                            "response.output_item.added",
                            output_index=index,
                            item={**text_item, "content": []},
                        )
                        yield self._event(
                            "response.content_part.added",
                            item_id=text_item["id"],
                            output_index=index,
                            content_index=0,
                            part=_text_part(""),
                        )
                    text_item["content"][0]["text"] += content
                    yield self._event(
                        "response.output_text.delta",
                        item_id=text_item["id"],
                        output_index=output.index(text_item),
                        content_index=0,
                        delta=content,
                        logprobs=[],
                    )
                for tc in body.get("tool_calls") or []:
                    item = calls.get(tc["index"])
                    fn = tc.get("function", {})
                    if item is None:
                        item = _call_item(
                            f"fc_{uuid.uuid4().hex}", tc.get("id", ""), fn.get("name", ""), ""
                        )
                        item["status"] = "in_progress"
                        calls[tc["index"]] = item
                        output.append(item)
                        yield self._event(
                            "response.output_item.added",
                            output_index=len(output) - 1,
                            item=dict(item),
                        )
                    piece = fn.get("arguments") or ""
                    if piece:
                        item["arguments"] += piece
                        yield self._event(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=output.index(item),
                            delta=piece,
                        )
        except APIError as e:
            yield error_event(e)
            return
        except Exception as e:  # engine failure: OpenAI's error event, then stop
            yield self._event(
                "error", code="server_error", message=str(e) or type(e).__name__, param=None
            )
            return
        for index, item in enumerate(output):
            item["status"] = "completed"
            if item["type"] == "message":
                part = item["content"][0]
                yield self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
                yield self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            else:
                yield self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            yield self._event("response.output_item.done", output_index=index, item=item)
        from kvserve.entrypoints.openai_render import usage as chat_usage

        status = "incomplete" if finish == "length" else "completed"
        final = self.envelope(status, output, self.usage(chat_usage(choices)))
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self._event(kind, response=final)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)],
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


async def start_response(serving: OpenAIServing, req: ResponsesRequest) -> ResponseRun:
    """Validate ``req`` and queue it; the caller must drain or abort the run."""
    chat = to_chat(req)
    try:
        gen = await serving.start_chat(chat)
    except APIError as e:
        if e.param == "max_completion_tokens":  # the chat field this request's maps to
            note = " (max_tokens is this request's max_completion_tokens)"
            e.param = "max_output_tokens"
            e.message = e.message.replace(note, "").replace("max_tokens", "max_output_tokens")
            e.args = (e.message,)
        raise
    return ResponseRun(serving, req, chat, gen)
