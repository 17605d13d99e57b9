"""``POST /v1/responses``: OpenAI's Responses API (the OpenAI Agents SDK's default),
served by translating each request into a chat completion on the same engine
(the request model and the translation: ``responses_protocol``).

Output: a ``response`` object whose ``output`` holds one ``message`` item
(``output_text`` content) when the model wrote text and one ``function_call``
item per call. Streamed, the events are OpenAI's: ``response.created``,
``response.in_progress``, per item ``response.output_item.added``, text as
``response.content_part.added`` / ``response.output_text.delta`` /
``response.output_text.done`` / ``response.content_part.done``, calls as
``response.function_call_arguments.delta`` / ``.done``, then
``response.output_item.done``, and last ``response.completed`` with the whole
response; each carries ``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvserve.entrypoints.chat_protocol import ChatCompletionRequest
from kvserve.entrypoints.openai_errors import APIError
from kvserve.entrypoints.openai_serving import Generation, OpenAIServing
from kvserve.entrypoints.responses_protocol import ResponsesRequest, to_chat
from kvserve.entrypoints.serving_chat import start_chat
from kvserve.entrypoints.serving_streams import abort_all, check_finish, error_event, merge


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
                check_finish(delta)
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
        gen = await start_chat(serving, chat)
    except APIError as e:
        if e.param == "max_completion_tokens":  # the chat field this request's maps to
            note = " (max_tokens is this request's max_completion_tokens)"
            e.param = "max_output_tokens"
            e.message = e.message.replace(note, "").replace("max_tokens", "max_output_tokens")
            e.args = (e.message,)
        raise
    return ResponseRun(serving, req, chat, gen)
