"""POST /v1/completions on :class:`OpenAIServing`: prompts (strings or token ids)
tokenized off the event loop, one engine request per prompt and sample, echo."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from kvserve.engine.request_limits import check_prompt_count
from kvserve.entrypoints.completions_protocol import CompletionRequest
from kvserve.entrypoints.openai_errors import request_error_to_api
from kvserve.entrypoints.openai_protocol import COMPLETIONS_DEFAULT_MAX_TOKENS
from kvserve.entrypoints.openai_render import CompletionRenderer
from kvserve.entrypoints.openai_serving import Generation, OpenAIServing, include_usage
from kvserve.request import RequestError, SamplingParams

# Per-prompt work on the event loop yields after this many prompts of one request.
YIELD_EVERY = 32


async def start_completion(serving: OpenAIServing, req: CompletionRequest) -> Generation:
    """Validate and queue every prompt (all or none)."""
    lora_name = serving.check_model(req.model)
    req.check()
    try:  # before tokenizing anything
        check_prompt_count(len(req.prompts()), serving.max_prompts_per_request)
    except RequestError as e:
        raise request_error_to_api(e, req.param_names("max_tokens")) from None
    inputs: list[tuple[str | None, list[int], SamplingParams]] = []
    echo_texts: list[str] = []
    prompt_ids: list[list[int]] = []
    prompts = req.prompts()
    # A completion prompt is the client's whole prompt: special-token strings in it
    # are special tokens, as in vLLM (chat messages are not: see chat.prompt).
    size = sum(len(p) for p in prompts)
    encoded = await serving.cpu.run_unless_small(size, encode_prompts, serving, prompts)
    for k, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
        if k % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)  # bounded event-loop slices for big batches
        text = prompt if isinstance(prompt, str) else None
        max_tokens = 1 if req.echo_only else req.max_tokens  # echo only: one unused token
        if max_tokens is None:
            # Never below 1, so that a too-long prompt is refused for its length.
            room = max(serving.engine.max_model_len - len(ids), 1)
            max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        params = req.sampling_params(
            max_tokens,
            req.logprobs,
            max_tokens_param="max_tokens",
            defaults=serving.sampling_defaults,
        )
        params = dataclasses.replace(params, prompt_logprobs=req.engine_prompt_logprobs)
        params = serving.seeds.fill(params)
        inputs.append((text, ids, params))
        prompt_ids.append(ids)
    if req.echo:
        size = sum(len(i) for i in prompt_ids)
        echo_texts = await serving.cpu.run_unless_small(
            size, _echo_texts, serving, prompts, prompt_ids
        )
    req_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await serving.submit(
        req_id, inputs, req.cache_salt, req.param_names("max_tokens"), lora_name
    )
    num_samples = inputs[0][2].num_samples
    prompt_index = [i // num_samples for i in range(len(streams))]
    renderer = CompletionRenderer(req, serving.token_texts, echo_texts, prompt_ids, prompt_index)
    return Generation(
        req_id,
        streams,
        renderer,
        include_usage(req),
        prompt_index,
        n=inputs[0][2].n,
        num_samples=num_samples,
        count_outputs=not req.echo_only,
        model=lora_name,
    )


def encode_prompts(serving: OpenAIServing, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of completion prompts (strings encoded, id lists copied); a string
    too long to fit ``max_model_len`` whatever its tokens is refused untokenized
    (:attr:`OpenAIServing.max_prompt_chars`). Blocking."""
    limit = serving.max_prompt_chars
    for i, p in enumerate(prompts):
        if isinstance(p, str) and limit is not None and len(p) > limit:
            max_len = serving.engine.max_model_len
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
    return [list(serving.tokenizer.encode(p)) if isinstance(p, str) else list(p) for p in prompts]


def _echo_texts(
    serving: OpenAIServing, prompts: list[str | list[int]], ids: list[list[int]]
) -> list[str]:
    """The echoed text of each prompt (id prompts decoded; out-of-vocabulary ids
    are refused by ``submit``, so they decode to nothing here). Blocking."""
    vocab = serving.engine.vocab_size
    return [
        p
        if isinstance(p, str)
        else str(serving.tokenizer.decode(i))
        if all(0 <= t < vocab for t in i)
        else ""
        for p, i in zip(prompts, ids, strict=True)
    ]
