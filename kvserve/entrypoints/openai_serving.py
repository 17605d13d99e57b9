"""Completions and chat completions: requests in, engine streams, OpenAI responses out.

This module turns parsed requests (``openai_protocol``) into engine requests on an
:class:`AsyncEngine` and the engine's :class:`RequestDelta` streams into OpenAI's
response and Server-Sent-Event chunk shapes. ``openai_server`` owns HTTP (routing,
auth, error bodies, disconnects); nothing here touches the transport.

One streaming skeleton serves both endpoints (:meth:`OpenAIServing.events` and
:meth:`OpenAIServing.response`): the envelope ``{"id", "object", "created", "model",
"choices"}``, ``"usage"`` (``null`` on chunks when ``stream_options.include_usage``,
then one last chunk with empty ``choices`` and the usage) and ``data: [DONE]``; the
per-choice shapes come from the endpoint's renderer (``openai_render``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvserve.engine.admission import DEFAULT_MAX_PROMPTS_PER_REQUEST, check_prompt_count
from kvserve.engine.async_engine import (
    EngineUnavailableError,
    KVTransferFailedError,
    QueueFullError,
    RequestFailedError,
)
from kvserve.engine.client import DeltaStream, EngineClient
from kvserve.engine.outputs import RequestDelta
from kvserve.entrypoints.chat.prompt import (
    ChatPrompt,
    ChatPromptBuilder,
    ChatPromptError,
    TemplateError,
)
from kvserve.entrypoints.chat.render_pool import RenderBusyError
from kvserve.entrypoints.chat.template import TemplateTimeoutError
from kvserve.entrypoints.chat.tools import TOOL_PARAM_NAMES, ToolOutput, plan_tools
from kvserve.entrypoints.openai_errors import APIError, bad_request, request_error_to_api
from kvserve.entrypoints.openai_protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
)
from kvserve.entrypoints.openai_render import (
    ChatRenderer,
    Choice,
    CompletionRenderer,
    Renderer,
    best_choices,
    usage,
)
from kvserve.entrypoints.token_texts import TokenTexts
from kvserve.entrypoints.workers import CpuPool
from kvserve.request import RequestError, SamplingParams

RETRY_AFTER_S = 1
logger = logging.getLogger("kvserve.requests")


class SeedSource:
    """``--seed``: requests without a ``seed`` get the next draw of one generator
    seeded once, so a server started with the same seed and sent the same requests
    in the same order samples the same tokens (vLLM's engine-wide seed). Without
    ``--seed`` requests are left unseeded."""

    def __init__(self, seed: int | None) -> None:
        import random

        self._rng = random.Random(seed) if seed is not None else None

    def fill(self, params: SamplingParams) -> SamplingParams:
        if self._rng is None or params.seed is not None:
            return params
        return dataclasses.replace(params, seed=self._rng.getrandbits(63))


# Per-prompt work on the event loop yields after this many prompts of one request.
YIELD_EVERY = 32


# --------------------------------------------------------------------- streams
def _check_finish(delta: RequestDelta) -> None:
    if delta.finish_reason == "abort":
        # The client did not ask for this abort (it would not be reading any more):
        # the engine failed on this request's step.
        raise RequestFailedError(
            "the engine failed while generating this completion; retry the request"
        )


async def merge(streams: list[DeltaStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave several streams as (index, delta) in arrival order."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: DeltaStream) -> None:
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
    if isinstance(e, EngineUnavailableError):
        return sse(APIError(503, str(e), type="server_error", code="engine_unavailable").body())
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
@dataclass
class Generation:
    """One HTTP request's queued engine requests (one stream per sample: prompt ``p``
    sample ``j`` is stream ``p * num_samples + j``) and the renderer of its endpoint.
    ``n`` choices per prompt are returned (the best ``n`` of ``num_samples`` by
    cumulative logprob when ``best_of > n``). The caller must drain or abort every
    stream."""

    req_id: str
    streams: list[DeltaStream]
    renderer: Renderer
    include_usage: bool
    prompt_index: list[int]
    n: int = 1
    num_samples: int = 1
    count_outputs: bool = True

    def new_choices(self) -> list[Choice]:
        return [Choice(index=i, prompt_index=p) for i, p in enumerate(self.prompt_index)]


def _include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


class OpenAIServing:
    """Completions and chat on one engine. Methods raise :class:`APIError` for any
    request that cannot be served; once they return, the engine holds the request(s)
    and the caller must drain or abort the returned streams."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        served_model_name: str,
        max_queue_len: int | None = None,
        max_prompts_per_request: int | None = DEFAULT_MAX_PROMPTS_PER_REQUEST,
        tool_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        default_seed: int | None = None,
        sampling_defaults: dict[str, Any] | None = None,
        max_logprobs: int = 20,
        log_requests: bool = False,
        chat: ChatPromptBuilder | None = None,
        cpu: CpuPool | None = None,
        chat_threads: CpuPool | None = None,
    ) -> None:
        """``tool_parser`` + ``enable_auto_tool_choice``: read tool calls out of the
        text for ``tool_choice: "auto"`` (``chat/tools.py``); ``default_seed``: the
        seed source of requests that send none (``--seed``); ``sampling_defaults``:
        sampling fields a request leaves out take these (``--generation-config``);
        ``max_logprobs``: most logprobs a request may ask for; ``log_requests``: one
        log line per queued request."""
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_logprobs = max_logprobs
        self.log_requests = log_requests
        self.tool_parser = tool_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.seeds = SeedSource(default_seed)
        self.engine = engine
        self.max_prompts_per_request = max_prompts_per_request
        self.tokenizer = engine.tokenizer
        self.served_model_name = served_model_name
        self.max_queue_len = max_queue_len
        self.token_texts = TokenTexts(engine.tokenizer)
        # Chat prompts (template, sandbox, safe tokenization) and the threads that
        # keep tokenization and rendering off the event loop.
        self.chat = chat if chat is not None else ChatPromptBuilder(engine.tokenizer)
        self.cpu = cpu if cpu is not None else CpuPool(4, "kvserve-cpu")
        self.chat_threads = chat_threads if chat_threads is not None else self.cpu

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
    ) -> list[DeltaStream]:
        """Queue every prompt, all or none: each is validated once (``make_request``)
        before any is queued. Returns one stream per sample, prompt by prompt.
        Refusals become APIError naming the request's field (``names``: engine field
        -> request field)."""
        for _, ids, params in inputs:
            self.check_logprobs(params, names)
            if self.log_requests:
                logger.info("request %s: %d prompt tokens, params %s", req_id, len(ids), params)

        def make_all() -> list[Any]:
            return [
                self.engine.make_request(
                    ids,
                    params,
                    request_id=req_id if len(inputs) == 1 else f"{req_id}-{i}",
                    prompt=text,
                    cache_salt=cache_salt,
                )
                for i, (text, ids, params) in enumerate(inputs)
            ]

        try:  # validation walks every token id: off the event loop
            size = sum(len(ids) for _, ids, _ in inputs)
            requests = await self.cpu.run_unless_small(size, make_all)
        except RequestError as e:
            raise request_error_to_api(e, names) from None
        streams: list[DeltaStream] = []
        try:
            # All prompts' sequences are admitted together or refused together.
            for group in await self.engine.submit_all(requests, max_waiting=self.max_queue_len):
                streams += group
        except BaseException as e:
            if isinstance(e, QueueFullError):
                raise APIError(
                    429,
                    f"the server is busy: {e}",
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

    def check_logprobs(self, params: SamplingParams, names: dict[str, str]) -> None:
        """400 when a request asks for more logprobs than ``--max-logprobs``."""
        for field_name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, field_name)
            if value is not None and value > self.max_logprobs:
                param = names.get(field_name, field_name)
                raise bad_request(
                    f"{param}={value} is more than this server allows (--max-logprobs "
                    f"{self.max_logprobs}): ask for at most {self.max_logprobs}",
                    param=param,
                )

    async def collect(self, gen: Generation) -> list[Choice]:
        """Drain the streams into one choice each (all samples, best_of included);
        engine failures become a 500."""
        choices = gen.new_choices()
        try:
            async for i, delta in merge(gen.streams):
                _check_finish(delta)
                choices[i].add(delta)
        except KVTransferFailedError as e:
            raise APIError(
                503,
                f"the prompt's KV could not be brought from a prefill worker: {e}; retry",
                type="server_error",
                code="kv_transfer_failed",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except EngineUnavailableError as e:  # shutting down: the request was cut
            raise APIError(
                503,
                str(e),
                type="server_error",
                code="engine_unavailable",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except RequestFailedError as e:
            raise APIError(500, str(e), type="server_error", code=500) from None
        return choices

    # ------------------------------------------------------------------ completions
    async def start_completion(self, req: CompletionRequest) -> Generation:
        """Validate and queue every prompt (all or none)."""
        self.check_model(req.model)
        req.check()
        try:  # before tokenizing anything
            check_prompt_count(len(req.prompts()), self.max_prompts_per_request)
        except RequestError as e:
            raise request_error_to_api(e, req.param_names("max_tokens")) from None
        inputs: list[tuple[str | None, list[int], SamplingParams]] = []
        echo_texts: list[str] = []
        prompt_ids: list[list[int]] = []
        prompts = req.prompts()
        # A completion prompt is the client's whole prompt: special-token strings in it
        # are special tokens, as in vLLM (chat messages are not: see chat.prompt).
        size = sum(len(p) for p in prompts)
        encoded = await self.cpu.run_unless_small(size, self.encode_prompts, prompts)
        for k, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
            if k % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)  # bounded event-loop slices for big batches
            text = prompt if isinstance(prompt, str) else None
            max_tokens = 1 if req.echo_only else req.max_tokens  # echo only: one unused token
            if max_tokens is None:
                # Never below 1, so that a too-long prompt is refused for its length.
                room = max(self.engine.max_model_len - len(ids), 1)
                max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
            params = req.sampling_params(
                max_tokens,
                req.logprobs,
                max_tokens_param="max_tokens",
                defaults=self.sampling_defaults,
            )
            params = dataclasses.replace(params, prompt_logprobs=req.engine_prompt_logprobs)
            params = self.seeds.fill(params)
            inputs.append((text, ids, params))
            prompt_ids.append(ids)
        if req.echo:
            size = sum(len(i) for i in prompt_ids)
            echo_texts = await self.cpu.run_unless_small(
                size, self._echo_texts, prompts, prompt_ids
            )
        req_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.submit(req_id, inputs, req.cache_salt, req.param_names("max_tokens"))
        num_samples = inputs[0][2].num_samples
        prompt_index = [i // num_samples for i in range(len(streams))]
        renderer = CompletionRenderer(req, self.token_texts, echo_texts, prompt_ids, prompt_index)
        return Generation(
            req_id,
            streams,
            renderer,
            _include_usage(req),
            prompt_index,
            n=inputs[0][2].n,
            num_samples=num_samples,
            count_outputs=not req.echo_only,
        )

    def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of completion prompts (strings encoded, id lists copied); a string
        too long to fit ``max_model_len`` whatever its tokens is refused untokenized
        (:attr:`max_prompt_chars`). Blocking."""
        limit = self.max_prompt_chars
        for i, p in enumerate(prompts):
            if isinstance(p, str) and limit is not None and len(p) > limit:
                max_len = self.engine.max_model_len
                raise request_error_to_api(
                    RequestError(
                        f"prompt {i} has {len(p)} characters, more than the {max_len} tokens "
                        f"max_model_len allows (no token of this model is longer than "
                        f"{limit // max_len} characters): shorten the prompt",
                        param="prompt",
                        code="context_length_exceeded",
                    ),
                    {},
                )
        return [list(self.tokenizer.encode(p)) if isinstance(p, str) else list(p) for p in prompts]

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """Characters past which a prompt cannot fit ``max_model_len`` tokens: the
        longest vocabulary entry x ``max_model_len``, for tokenizers without a
        normalizer (which could drop characters; byte-level BPE such as the default
        model's has none, and its entries are at least as long as their text).
        None when no such bound holds."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return None
        try:
            longest = max(len(k) for k in self.tokenizer.get_vocab())
        except Exception:  # a tokenizer without a vocabulary dict: no bound
            return None
        return max(longest, 1) * self.engine.max_model_len

    def _echo_texts(self, prompts: list[str | list[int]], ids: list[list[int]]) -> list[str]:
        """The echoed text of each prompt (id prompts decoded; out-of-vocabulary ids
        are refused by ``submit``, so they decode to nothing here). Blocking."""
        vocab = self.engine.vocab_size
        return [
            p
            if isinstance(p, str)
            else str(self.tokenizer.decode(i))
            if all(0 <= t < vocab for t in i)
            else ""
            for p, i in zip(prompts, ids, strict=True)
        ]

    # ------------------------------------------------------------------ chat
    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        """The chat prompt (``ChatPromptBuilder.build`` on a worker thread); its
        refusals as APIError: 400 (template refused, too slow, not allowed), 503 when
        every render worker is busy."""
        try:
            return await self.chat_threads.run(
                self.chat.build,
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
        except ChatPromptError as e:
            raise bad_request(str(e), param=e.param, code=e.code) from None
        except RenderBusyError as e:
            raise APIError(
                503,
                str(e),
                type="server_error",
                code="chat_template_busy",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except TemplateTimeoutError as e:
            raise bad_request(str(e), param="messages", code="chat_template_timeout") from None
        except TemplateError as e:
            raise bad_request(str(e), param="messages", code="chat_template_error") from None

    async def start_chat(self, req: ChatCompletionRequest) -> Generation:
        """Validate and queue the conversation."""
        self.check_model(req.model)
        req.check()
        plan = plan_tools(
            req.tools,
            req.tool_choice,
            req.parallel_tool_calls,
            tool_parser=self.tool_parser,
            auto_enabled=self.enable_auto_tool_choice,
        )
        prompt = await self.render_chat(
            [m.as_template_dict() for m in req.messages],
            tools=plan.template_tools,
            add_generation_prompt=req.add_generation_prompt,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
        )
        text, ids = prompt.text, prompt.token_ids
        max_tokens, max_param = req.requested_max_tokens
        params = req.sampling_params(
            max_tokens,
            req.num_logprobs,
            max_tokens_param=max_param,
            defaults=self.sampling_defaults,
        )
        params = self.seeds.fill(params)
        req_id = f"chatcmpl-{uuid.uuid4().hex}"
        names = req.param_names(max_param)
        forced = plan.structured()
        if forced is not None:
            if params.structured_outputs is not None:
                raise bad_request(
                    f"tool_choice {plan.mode!r} constrains the output to tool calls, so it "
                    "cannot be combined with response_format or structured_outputs: drop one",
                    param="tool_choice",
                )
            params = dataclasses.replace(params, structured_outputs=forced)
            names = {**names, **TOOL_PARAM_NAMES}
        streams = await self.submit(req_id, [(text, ids, params)], req.cache_salt, names)
        renderer = ChatRenderer(
            req, self.token_texts, ids, ToolOutput(plan, len(streams), max_tokens)
        )
        return Generation(
            req_id, streams, renderer, _include_usage(req), [0] * len(streams), n=params.n
        )

    # ------------------------------------------------------------------ responses
    def _envelope(
        self, gen: Generation, obj: str, created: int, choices: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return {
            "id": gen.req_id,
            "object": obj,
            "created": created,
            "model": self.served_model_name,
            "choices": choices,
        }

    def response(self, gen: Generation, choices: list[Choice]) -> dict[str, Any]:
        """The non-streamed response from the collected choices (all samples; the
        best ``n`` per prompt are returned, usage counts them all)."""
        returned = best_choices(choices, gen.n) if gen.num_samples > gen.n else choices
        body = self._envelope(
            gen,
            gen.renderer.response_object,
            int(time.time()),
            [gen.renderer.choice(c) for c in returned],
        )
        return {
            **body,
            **gen.renderer.response_fields(choices),
            "usage": usage(choices, count_outputs=gen.count_outputs),
            "system_fingerprint": None,
        }

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        """The Server-Sent Events of a streamed response: the renderer's opening
        chunks, one chunk per delta it renders, the usage chunk when asked for,
        then ``[DONE]``. An engine failure becomes an error event before ``[DONE]``."""
        created = int(time.time())
        obj = gen.renderer.chunk_object
        choices = gen.new_choices()

        def chunk(choice: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
            body = {**self._envelope(gen, obj, created, [choice]), **(extra or {})}
            if gen.include_usage:
                body["usage"] = None
            return sse(body)

        try:
            for opening in gen.renderer.opening_chunks(len(gen.streams)):
                yield chunk(opening)
            async for i, delta in merge(gen.streams):
                _check_finish(delta)
                choices[i].add(delta)
                rendered = gen.renderer.chunk(i, delta)
                if rendered is not None:
                    yield chunk(rendered, gen.renderer.chunk_fields(delta))
            if gen.include_usage:
                counts = usage(choices, count_outputs=gen.count_outputs)
                yield sse({**self._envelope(gen, obj, created, []), "usage": counts})
        except (RequestFailedError, EngineUnavailableError, APIError) as e:
            yield error_event(e)
        yield sse("[DONE]")


def abort_all(streams: list[DeltaStream]) -> Callable[[], None]:
    """A callback that aborts every unfinished stream (idempotent)."""

    def _abort() -> None:
        for s in streams:
            s.abort()

    return _abort
