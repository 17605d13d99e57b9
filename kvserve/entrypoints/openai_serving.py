"""Completions and chat completions: requests in, engine streams, OpenAI responses out.

This module turns parsed requests (``openai_protocol``) into engine requests on an
:class:`AsyncEngine` and the engine's :class:`RequestDelta` streams into OpenAI's
response and Server-Sent-Event chunk shapes. ``openai_server`` owns HTTP (routing,
auth, error bodies, disconnects); nothing here touches the transport.

Shapes (what the official ``openai`` client parses):
- completion: ``{"id": "cmpl-…", "object": "text_completion", "choices": [{"index",
  "text", "logprobs": {"tokens", "token_logprobs", "top_logprobs", "text_offset"},
  "finish_reason"}], "usage": {..., "prompt_tokens_details": {"cached_tokens"}}}``
- chat: ``{"id": "chatcmpl-…", "object": "chat.completion", "choices": [{"index",
  "message": {"role": "assistant", "content"}, "logprobs": {"content": [{"token",
  "logprob", "bytes", "top_logprobs"}]}, "finish_reason"}], "usage": …}``
- streams: chunks ``text_completion`` / ``chat.completion.chunk`` with
  ``"usage": null`` when ``stream_options.include_usage`` (then one last chunk with
  empty ``choices`` and the usage), and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.async_engine import (
    AsyncEngine,
    EngineUnavailableError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from kvserve.engine.outputs import RequestDelta
from kvserve.entrypoints.openai_protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    request_error_to_api,
)
from kvserve.request import FinishReason, RequestError, SamplingParams
from kvserve.sched.output import Logprobs

RETRY_AFTER_S = 1


# --------------------------------------------------------------------- token text
class TokenTexts:
    """Per-token strings and bytes for logprobs (cached; one per tokenizer).

    For byte-level BPE tokenizers (GPT-2 style, the default model) the bytes are the
    token's exact bytes, so a character split across tokens is reported as the
    pieces OpenAI would send; the string is their UTF-8 decoding (U+FFFD where a
    piece is not a whole character).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        decoder = _byte_decoder()
        probe = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a b", add_special_tokens=False))
        self._byte_decoder = decoder if any("\u0120" in (t or "") for t in probe) else None

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw: bytes | None = None
        if self._byte_decoder is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_decoder for c in piece):
                raw = bytes(self._byte_decoder[c] for c in piece)
        if raw is None:
            raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        out = (raw.decode("utf-8", errors="replace"), raw)
        if len(self._cache) < 1 << 17:
            self._cache[token_id] = out
        return out

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character map, inverted."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


# --------------------------------------------------------------------- accumulation
@dataclass
class _Choice:
    """Everything one prompt's stream produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.new_text
        self.token_ids.extend(delta.new_token_ids)
        self.logprobs.extend(delta.new_logprobs)
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_output_tokens = delta.num_output_tokens
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


def usage(choices: list[_Choice]) -> dict[str, Any]:
    prompt = sum(c.num_prompt_tokens for c in choices)
    completion = sum(c.num_output_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in choices)},
    }


def _check_finish(delta: RequestDelta) -> None:
    if delta.finish_reason == "abort":
        # The client did not ask for this abort (it would not be reading any more):
        # the engine failed on this request's step.
        raise RequestFailedError(
            "the engine failed while generating this completion; retry the request"
        )


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave several streams as (index, delta) in arrival order."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        else:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def error_event(e: BaseException) -> str:
    if isinstance(e, APIError):
        return sse(e.body())
    return sse(
        {
            "error": {
                "message": str(e) or type(e).__name__,
                "type": "server_error",
                "param": None,
                "code": 500,
            }
        }
    )


# --------------------------------------------------------------------- serving
class OpenAIServing:
    """Completions and chat on one engine. Methods raise :class:`APIError` for any
    request that cannot be served; once they return, the engine holds the request(s)
    and the caller must drain or abort the returned streams."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        served_model_name: str,
        max_queue_len: int | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_name = served_model_name
        self.max_queue_len = max_queue_len
        self.token_texts = TokenTexts(engine.tokenizer)

    # ------------------------------------------------------------------ common
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist: this server serves "
                f"{self.served_model_name!r} (GET /v1/models lists it)",
                param="model",
                code="model_not_found",
            )

    async def submit(
        self,
        req_id: str,
        inputs: list[tuple[str | None, list[int], SamplingParams]],
        cache_salt: str | None,
        names: dict[str, str],
    ) -> list[RequestStream]:
        """Queue every prompt, all or none: each is validated once (``make_request``)
        before any is queued. Refusals become APIError naming the request's field
        (``names``: engine field -> request field)."""
        requests = []
        try:
            for i, (text, ids, params) in enumerate(inputs):
                requests.append(
                    self.engine.make_request(
                        ids,
                        params,
                        request_id=req_id if len(inputs) == 1 else f"{req_id}-{i}",
                        prompt=text,
                        cache_salt=cache_salt,
                    )
                )
        except RequestError as e:
            raise request_error_to_api(e, names) from None
        streams: list[RequestStream] = []
        try:
            for i, request in enumerate(requests):
                # One queue-length check per HTTP request: a batch is admitted whole.
                max_waiting = self.max_queue_len if i == 0 else None
                streams.append(await self.engine.submit(request, max_waiting=max_waiting))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, QueueFullError):
                raise APIError(
                    503,
                    f"the server is overloaded: {e}",
                    type="server_error",
                    code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None
            if isinstance(e, EngineUnavailableError):
                raise APIError(
                    503,
                    str(e),
                    type="server_error",
                    code="engine_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None
            if isinstance(e, RequestError):
                raise request_error_to_api(e, names) from None
            raise
        return streams

    async def collect(self, streams: list[RequestStream]) -> list[_Choice]:
        """Drain the streams into one choice each; engine failures become a 500."""
        choices = [_Choice(index=i) for i in range(len(streams))]
        try:
            async for i, delta in merge(streams):
                _check_finish(delta)
                choices[i].add(delta)
        except (RequestFailedError, EngineUnavailableError) as e:
            raise APIError(500, str(e), type="server_error", code=500) from None
        return choices

    # ------------------------------------------------------------------ completions
    async def start_completion(
        self, req: CompletionRequest
    ) -> tuple[str, list[RequestStream], list[str]]:
        """Validate and queue; returns (id, streams, prompt texts for echo)."""
        self.check_model(req.model)
        req.check()
        inputs: list[tuple[str | None, list[int], SamplingParams]] = []
        echo_texts: list[str] = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                text: str | None = prompt
                ids = list(self.tokenizer.encode(prompt))
            else:
                text, ids = None, prompt
            max_tokens = req.max_tokens
            if max_tokens is None:
                # Never below 1, so that a too-long prompt is refused for its length.
                room = max(self.engine.max_model_len - len(ids), 1)
                max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
            params = req.sampling_params(max_tokens, req.logprobs, max_tokens_param="max_tokens")
            inputs.append((text, ids, params))
            if req.echo:
                echo_texts.append(text if text is not None else str(self.tokenizer.decode(ids)))
        req_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.submit(req_id, inputs, req.cache_salt, req.param_names("max_tokens"))
        return req_id, streams, echo_texts

    def completion_logprobs(
        self, token_ids: list[int], logprobs: list[Logprobs], offset: int
    ) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp in zip(token_ids, logprobs, strict=False):
            tok = self.token_texts.text(tid)
            top = {
                self.token_texts.text(t): _finite(v)
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=False)
            }
            top.setdefault(tok, _finite(lp.sampled_logprob))
            tokens.append(tok)
            token_lps.append(_finite(lp.sampled_logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def completion_response(
        self, req: CompletionRequest, req_id: str, choices: list[_Choice], echo: list[str]
    ) -> dict[str, Any]:
        out = []
        for c in choices:
            lp = None
            if req.logprobs is not None:
                lp = self.completion_logprobs(c.token_ids, c.logprobs, 0)
            out.append(
                {
                    "index": c.index,
                    "text": (echo[c.index] if echo else "") + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return {
            "id": req_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": out,
            "usage": usage(choices),
            "system_fingerprint": None,
        }

    async def completion_events(
        self, req: CompletionRequest, req_id: str, streams: list[RequestStream], echo: list[str]
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        choices = [_Choice(index=i) for i in range(len(streams))]
        offsets = [0] * len(streams)

        def chunk(choice: dict[str, Any]) -> str:
            body: dict[str, Any] = {
                "id": req_id,
                "object": "text_completion",
                "created": created,
                "model": self.served_model_name,
                "choices": [choice],
            }
            if include_usage:
                body["usage"] = None
            return sse(body)

        try:
            for i, text in enumerate(echo):
                yield chunk({"index": i, "text": text, "logprobs": None, "finish_reason": None})
            async for i, delta in merge(streams):
                _check_finish(delta)
                choices[i].add(delta)
                if not (delta.new_text or delta.finished or delta.new_token_ids):
                    continue
                lp = None
                if req.logprobs is not None:
                    lp = self.completion_logprobs(
                        delta.new_token_ids, delta.new_logprobs, offsets[i]
                    )
                    offsets[i] += sum(len(t) for t in lp["tokens"])
                elif not delta.new_text and not delta.finished:
                    continue
                yield chunk(
                    {
                        "index": i,
                        "text": delta.new_text,
                        "logprobs": lp,
                        "finish_reason": delta.finish_reason,
                        "stop_reason": delta.stop_reason,
                    }
                )
            if include_usage:
                yield sse(
                    {
                        "id": req_id,
                        "object": "text_completion",
                        "created": created,
                        "model": self.served_model_name,
                        "choices": [],
                        "usage": usage(choices),
                    }
                )
        except (RequestFailedError, EngineUnavailableError, APIError) as e:
            yield error_event(e)
        yield sse("[DONE]")

    # ------------------------------------------------------------------ chat
    def render_chat(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        messages = [m.as_template_dict() for m in req.messages]
        try:
            text = str(
                self.tokenizer.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=req.add_generation_prompt,
                    **(req.chat_template_kwargs or {}),
                )
            )
        except Exception as e:  # jinja errors raised by the template itself
            raise bad_request(
                f"the model's chat template refused these messages: {e}", param="messages"
            ) from None
        return text, list(self.tokenizer.encode(text, add_special_tokens=False))

    async def start_chat(self, req: ChatCompletionRequest) -> tuple[str, list[RequestStream]]:
        self.check_model(req.model)
        req.check()
        text, ids = self.render_chat(req)
        max_tokens, max_param = req.requested_max_tokens
        params = req.sampling_params(max_tokens, req.num_logprobs, max_tokens_param=max_param)
        req_id = f"chatcmpl-{uuid.uuid4().hex}"
        names = req.param_names(max_param)
        streams = await self.submit(req_id, [(text, ids, params)], req.cache_salt, names)
        return req_id, streams

    def chat_logprobs(
        self, token_ids: list[int], logprobs: list[Logprobs], num_top: int
    ) -> dict[str, Any]:
        content = []
        for tid, lp in zip(token_ids, logprobs, strict=False):
            tok, raw = self.token_texts.get(tid)
            top = []
            for t, v in list(zip(lp.top_token_ids, lp.top_logprobs, strict=False))[:num_top]:
                t_text, t_raw = self.token_texts.get(t)
                top.append({"token": t_text, "logprob": _finite(v), "bytes": list(t_raw)})
            content.append(
                {
                    "token": tok,
                    "logprob": _finite(lp.sampled_logprob),
                    "bytes": list(raw),
                    "top_logprobs": top,
                }
            )
        return {"content": content, "refusal": None}

    def chat_response(
        self, req: ChatCompletionRequest, req_id: str, choices: list[_Choice]
    ) -> dict[str, Any]:
        out = []
        for c in choices:
            lp = None
            if req.logprobs:
                lp = self.chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
            out.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return {
            "id": req_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": out,
            "usage": usage(choices),
            "system_fingerprint": None,
        }

    async def chat_events(
        self, req: ChatCompletionRequest, req_id: str, streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        choices = [_Choice(index=i) for i in range(len(streams))]

        def chunk(choice: dict[str, Any]) -> str:
            body: dict[str, Any] = {
                "id": req_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.served_model_name,
                "choices": [choice],
            }
            if include_usage:
                body["usage"] = None
            return sse(body)

        try:
            for i in range(len(streams)):
                yield chunk(
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            async for i, delta in merge(streams):
                _check_finish(delta)
                choices[i].add(delta)
                lp = None
                if req.logprobs and delta.new_token_ids:
                    lp = self.chat_logprobs(
                        delta.new_token_ids, delta.new_logprobs, req.top_logprobs or 0
                    )
                if not (delta.new_text or delta.finished or lp):
                    continue
                choice: dict[str, Any] = {
                    "index": i,
                    "delta": {"content": delta.new_text} if delta.new_text or lp else {},
                    "logprobs": lp,
                    "finish_reason": delta.finish_reason,
                }
                if delta.finished:
                    choice["stop_reason"] = delta.stop_reason
                yield chunk(choice)
            if include_usage:
                yield sse(
                    {
                        "id": req_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": self.served_model_name,
                        "choices": [],
                        "usage": usage(choices),
                    }
                )
        except (RequestFailedError, EngineUnavailableError, APIError) as e:
            yield error_event(e)
        yield sse("[DONE]")


def abort_all(streams: list[RequestStream]) -> Callable[[], None]:
    """A callback that aborts every unfinished stream (idempotent)."""

    def _abort() -> None:
        for s in streams:
            s.abort()

    return _abort
