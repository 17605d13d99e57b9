"""Completions and chat completions: requests in, engine streams, OpenAI responses out.

This module holds what both endpoints share: :class:`OpenAIServing` submits a
request's prompts to the engine (all or none) and turns the engine's
:class:`RequestDelta` streams into OpenAI's response and Server-Sent-Event chunk
shapes. The endpoints build on it: ``serving_completions`` (``start_completion``) and
``serving_chat`` (``start_chat``, ``render_chat``); ``serving_streams`` holds the
stream plumbing. ``openai_server`` owns HTTP (routing, auth, error bodies,
disconnects); nothing here touches the transport.

One streaming skeleton serves both endpoints (:meth:`OpenAIServing.events` and
:meth:`OpenAIServing.response`): the envelope ``{"id", "object", "created", "model",
"choices"}``, ``"usage"`` (``null`` on chunks when ``stream_options.include_usage``,
then one last chunk with empty ``choices`` and the usage) and ``data: [DONE]``; the
per-choice shapes come from the endpoint's renderer (``openai_render``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvserve.engine.async_engine import (
    EngineUnavailableError,
    KVTransferFailedError,
    QueueFullError,
    RequestFailedError,
)
from kvserve.engine.client import DeltaStream, EngineClient
from kvserve.engine.request_limits import DEFAULT_MAX_PROMPTS_PER_REQUEST
from kvserve.entrypoints.chat.prompt import ChatPromptBuilder
from kvserve.entrypoints.chat_protocol import ChatCompletionRequest
from kvserve.entrypoints.completions_protocol import CompletionRequest
from kvserve.entrypoints.openai_errors import APIError, bad_request, request_error_to_api
from kvserve.entrypoints.openai_render import Choice, Renderer, best_choices, usage
from kvserve.entrypoints.serving_streams import (
    check_finish,
    error_event,
    merge,
    retry_later,
    sse,
)
from kvserve.entrypoints.token_texts import TokenTexts
from kvserve.entrypoints.workers import CpuPool
from kvserve.lora.errors import LoRAError
from kvserve.lora.manager import LoRAManager
from kvserve.request import RequestError, SamplingParams

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
    model: str | None = None  # the name the response echoes (a LoRA adapter's); None: served

    def new_choices(self) -> list[Choice]:
        return [Choice(index=i, prompt_index=p) for i, p in enumerate(self.prompt_index)]


def include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def lora_error_to_api(e: LoRAError) -> APIError:
    """A LoRA refusal in OpenAI's error shape, with its status (400/404/409)."""
    code = {404: "model_not_found", 409: "conflict"}.get(e.status, "invalid_value")
    param = "model" if e.status == 404 else None
    return APIError(e.status, str(e), param=param, code=code)


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
        # resident LoRA adapters a request may name in ``model`` (None: LoRA off)
        self.lora: LoRAManager | None = getattr(engine, "lora_manager", None)
        self.max_queue_len = max_queue_len
        self.token_texts = TokenTexts(engine.tokenizer)
        # Chat prompts (template, sandbox, safe tokenization) and the threads that
        # keep tokenization and rendering off the event loop.
        self.chat = chat if chat is not None else ChatPromptBuilder(engine.tokenizer)
        self.cpu = cpu if cpu is not None else CpuPool(4, "kvserve-cpu")
        self.chat_threads = chat_threads if chat_threads is not None else self.cpu

    # ------------------------------------------------------------------ common
    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 for a name
        that is neither the served model nor a resident adapter."""
        if model is None or model == self.served_model_name:
            return None
        if self.lora is not None:
            try:
                return self.lora.resolve(model).name
            except LoRAError as e:
                raise APIError(
                    404,
                    f"{e} (or use the base model {self.served_model_name!r})",
                    param="model",
                    code="model_not_found",
                ) from None
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
        lora_name: str | None = None,
    ) -> list[DeltaStream]:
        """Queue every prompt, all or none: each is validated once (``make_request``)
        before any is queued. Returns one stream per sample, prompt by prompt.
        Refusals become APIError naming the request's field (``names``: engine field
        -> request field). ``lora_name``: the adapter (from :meth:`check_model`); an
        adapter unloaded meanwhile is a 404."""
        for _, ids, params in inputs:
            self.check_logprobs(params, names)
            if self.log_requests:
                logger.info("request %s: %d prompt tokens, params %s", req_id, len(ids), params)

        extra: dict[str, Any] = {} if lora_name is None else {"lora_name": lora_name}

        def make_all() -> list[Any]:
            return [
                self.engine.make_request(
                    ids,
                    params,
                    request_id=req_id if len(inputs) == 1 else f"{req_id}-{i}",
                    prompt=text,
                    cache_salt=cache_salt,
                    **extra,
                )
                for i, (text, ids, params) in enumerate(inputs)
            ]

        try:  # validation walks every token id, and compiles grammars: off the event loop
            size = sum(len(ids) for _, ids, _ in inputs)
            if any(params.structured_outputs is not None for _, _, params in inputs):
                requests = await self.cpu.run(make_all)
            else:
                requests = await self.cpu.run_unless_small(size, make_all)
        except RequestError as e:
            if e.code == "grammar_compiler_busy":  # every compile worker busy: retry
                raise retry_later(503, str(e), e.code) from None
            raise request_error_to_api(e, names) from None
        except LoRAError as e:
            raise lora_error_to_api(e) from None
        streams: list[DeltaStream] = []
        try:
            # All prompts' sequences are admitted together or refused together.
            for group in await self.engine.submit_all(requests, max_waiting=self.max_queue_len):
                streams += group
        except BaseException as e:
            if isinstance(e, QueueFullError):
                raise retry_later(429, f"the server is busy: {e}", "queue_full") from None
            if isinstance(e, EngineUnavailableError):
                raise retry_later(503, str(e), "engine_unavailable") from None
            if isinstance(e, RequestError):
                raise request_error_to_api(e, names) from None
            if isinstance(e, LoRAError):
                raise lora_error_to_api(e) from None
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
                check_finish(delta)
                choices[i].add(delta)
        except KVTransferFailedError as e:
            raise retry_later(
                503,
                f"the prompt's KV could not be brought from a prefill worker: {e}; retry",
                "kv_transfer_failed",
            ) from None
        except EngineUnavailableError as e:  # shutting down: the request was cut
            raise retry_later(503, str(e), "engine_unavailable") from None
        except RequestFailedError as e:
            raise APIError(500, str(e), type="server_error", code=500) from None
        return choices

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

    # ------------------------------------------------------------------ responses
    def _envelope(
        self, gen: Generation, obj: str, created: int, choices: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return {
            "id": gen.req_id,
            "object": obj,
            "created": created,
            "model": gen.model or self.served_model_name,
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
                check_finish(delta)
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
