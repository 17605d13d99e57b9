"""Offline API, shaped like vLLM's ``LLM``: many prompts in, one ``RequestOutput`` each.

    llm = LLM()                                   # default model
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    llm.generate(prompt_token_ids=[[1, 2, 3]])
    llm.chat([{"role": "user", "content": "Hi"}])

``generate`` validates every prompt before queueing any, so one bad prompt raises
:class:`~kvserve.request.RequestError` (a ValueError) and leaves the engine as it
was. Requests are batched continuously by the scheduler (chunked prefill, prefix
caching) and returned in input order.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kvserve.engine.args import build_engine_config
from kvserve.engine.engine_core import EngineCore
from kvserve.engine.offline_compat import chat_message, split_prompts, vllm_logprobs
from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.engine.vllm_compat import generation_defaults, translate_vllm_options
from kvserve.entrypoints.chat.prompt import ChatPromptBuilder
from kvserve.entrypoints.chat.template import load_chat_template
from kvserve.entrypoints.token_texts import TokenTexts
from kvserve.lora.config import LoRARequest
from kvserve.lora.errors import LoRAError
from kvserve.request import RequestError, SamplingParams

Message = dict[str, Any]
logger = logging.getLogger("kvserve.llm")


class LLM:
    """An engine on one model. ``engine_options`` are those of ``kvserve.engine.args``
    (``max_num_batched_tokens=256``, ``scheduler_policy="separated"``, ...); unknown names
    raise TypeError, bad values ValueError."""

    def __init__(
        self,
        model: str | None = None,
        *,
        seed: int | None = None,
        generation_config: str | None = "auto",
        chat_template: str | None = None,
        **engine_options: Any,
    ) -> None:
        """vLLM's GPU options (``tensor_parallel_size=1``, ``gpu_memory_utilization``,
        ``enforce_eager``, ``trust_remote_code``, ``tokenizer``, ...) are mapped or
        refused by :func:`~kvserve.engine.vllm_compat.translate_vllm_options` (the
        notices are logged). ``seed``: requests without a seed draw theirs from one
        generator seeded with it (same prompts in the same order: same outputs).
        ``generation_config``: the source of :meth:`get_default_sampling_params`
        (``auto``: the model's generation_config.json; ``vllm``: none; a folder).
        ``chat_template``: a template's text or a .jinja file (default: the model's)."""
        options, notices = translate_vllm_options({"model": model, **engine_options})
        for notice in notices:
            logger.info("%s", notice)
        config = build_engine_config(**options)
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.tokenizer
        self._seeds = random.Random(seed) if seed is not None else None
        self._defaults = generation_defaults(
            generation_config, getattr(self.engine.loaded, "model_dir", None)
        )
        self._texts: TokenTexts | None = None
        template = load_chat_template(chat_template) if chat_template is not None else None
        # The offline caller is the operator: a per-call chat_template is theirs to pass.
        self.chat_builder = ChatPromptBuilder(
            self.tokenizer, template=template, trust_request_template=True
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (vLLM's)."""
        return SamplingParams(**self._defaults)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt and return in order. ``prompts``: strings or
        vLLM's prompt dicts (``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``);
        or ``prompt_token_ids`` (not both). ``lora_request``: one adapter for every
        prompt, or one (or None: the base model) per prompt; the engine needs
        ``enable_lora=True``. An adapter not yet resident is loaded first (and stays
        loaded); a name already resident from another path is a LoRAError."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError(
                "pass exactly one of prompts (text) or prompt_token_ids (lists of ints)"
            )
        texts: list[str | None]
        if prompts is not None:
            pairs = split_prompts(prompts)
            texts = [t for t, _ in pairs]
            token_lists = [ids if ids is not None else self._encode(t or "") for t, ids in pairs]
        else:
            given: Sequence[Any] = prompt_token_ids or []
            if given and isinstance(given[0], int):
                given = [given]  # one prompt of token ids
            token_lists = [list(p) for p in given]
            texts = [None] * len(token_lists)
        loras = self._lora_names(lora_request, len(token_lists))
        return self._run(texts, token_lists, sampling_params, use_tqdm, cache_salt, loras)

    def _lora_names(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[str | None]:
        """The adapter name of each prompt, loading the adapters not yet resident."""
        if lora_request is None:
            return [None] * n
        reqs = [lora_request] * n if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(reqs) != n:
            raise ValueError(
                f"got {len(reqs)} lora_request entries for {n} prompts: pass one for all, "
                "or exactly one (or None) per prompt"
            )
        manager = self.engine.lora_manager
        names: list[str | None] = []
        for r in reqs:
            if r is None:
                names.append(None)
                continue
            if manager is None:
                raise LoRAError(
                    "lora_request needs an engine with LoRA: LLM(..., enable_lora=True)"
                )
            resident = {a.name: a for a in manager.adapters()}
            have = resident.get(r.lora_name)
            if have is None:
                manager.load(r.lora_name, r.lora_path, r.lora_int_id)
            elif str(Path(have.path)) != str(Path(r.lora_path).expanduser()):
                raise LoRAError(
                    f"LoRA adapter {r.lora_name!r} is loaded from {have.path!r}, not "
                    f"{r.lora_path!r}: use another lora_name for another adapter",
                    status=409,
                )
            names.append(r.lora_name)
        return names

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the model's, the ``LLM``'s, or ``chat_template``, a
        Jinja string) to one conversation (or a list of them) and generate. ``tools``
        (OpenAI's function tools) and ``chat_template_kwargs`` go to the template;
        content may be a list of text parts. The same renderer as the server
        (``kvserve.entrypoints.chat.prompt``): the template runs in the Jinja sandbox,
        and special-token strings inside message text are tokenized as plain text.
        The output is the model's text (parse calls from it with
        ``kvserve.entrypoints.chat.tool_parsers``). Raises ValueError for messages the
        template refuses."""
        conversations: list[Sequence[Message]]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        texts: list[str | None] = []
        token_lists: list[list[int]] = []
        for c, conv in enumerate(conversations):
            rendered = [chat_message(m, f"messages[{c}][{j}]") for j, m in enumerate(conv)]
            prompt = self.chat_builder.build(
                rendered,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
            texts.append(prompt.text)
            token_lists.append(prompt.token_ids)
        return self._run(texts, token_lists, sampling_params, use_tqdm, None, None)

    # ------------------------------------------------------------------ internals
    def _encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(
                f"prompts must be strings, got {type(text).__name__}; use prompt_token_ids for ids"
            )
        return list(self.tokenizer.encode(text))

    def _run(
        self,
        texts: list[str | None],
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        cache_salt: str | None,
        lora_names: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(token_lists)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(token_lists)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(token_lists):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(token_lists)} prompts: "
                    "pass one SamplingParams for all, or exactly one per prompt"
                )
        if self._seeds is not None:
            params_list = [
                p
                if p.seed is not None
                else dataclasses.replace(p, seed=self._seeds.getrandbits(63))
                for p in params_list
            ]
        engine = self.engine
        requests = []
        loras = lora_names if lora_names is not None else [None] * len(token_lists)
        for i, (text, ids, params, lora) in enumerate(
            zip(texts, token_lists, params_list, loras, strict=True)
        ):
            try:  # every prompt is validated before any is queued
                requests.append(
                    engine.make_request(
                        ids, params, prompt=text, cache_salt=cache_salt, lora_name=lora
                    )
                )
            except RequestError as e:
                raise RequestError(f"prompt {i}: {e}", param=e.param, code=e.code) from None

        results: dict[str, RequestOutput] = {}
        samples: dict[str, tuple[RequestOutput, CompletionOutput]] = {}  # sample id -> where
        order: list[str] = []
        try:
            for request in requests:
                req_id = engine.add(request)
                order.append(req_id)
                out = results[req_id] = RequestOutput(
                    request_id=req_id,
                    prompt=request.prompt,
                    prompt_token_ids=request.prompt_token_ids,
                    outputs=[],
                    finished=False,
                    num_cached_tokens=0,
                    metrics=RequestMetrics(arrival_time=0.0),
                )
                for sample in request.group:
                    comp = CompletionOutput(index=sample.sample_index, text="", token_ids=[])
                    out.outputs.append(comp)
                    samples[sample.req_id] = (out, comp)
            bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
            pending = set(samples)
            while pending:
                for delta in engine.step():
                    if delta.request_id not in samples:
                        continue
                    out, comp = samples[delta.request_id]
                    comp.text += delta.new_text
                    comp.token_ids.extend(delta.new_token_ids)
                    if delta.new_logprobs:
                        comp.logprobs = (comp.logprobs or []) + delta.new_logprobs
                    if delta.prompt_logprobs is not None:
                        out.prompt_logprobs = delta.prompt_logprobs
                    if delta.sample_index == 0:
                        out.num_cached_tokens = delta.num_cached_tokens
                        if delta.metrics is not None:
                            out.metrics = delta.metrics
                    if delta.finished:
                        comp.finish_reason = delta.finish_reason
                        comp.stop_reason = delta.stop_reason
                        pending.discard(delta.request_id)
                        if all(c.finished for c in out.outputs):
                            out.finished = True
                            bar.update(1)
                if pending and not engine.has_unfinished_requests():
                    raise RuntimeError(f"engine lost requests {sorted(pending)}")
            bar.close()
        except BaseException:
            engine.abort_requests([r for r, (_, c) in samples.items() if not c.finished])
            raise
        for out, params in zip((results[r] for r in order), params_list, strict=True):
            out.outputs = select_samples(out.outputs, params)
            self._vllm_shapes(out)
        return [results[r] for r in order]

    def _vllm_shapes(self, out: RequestOutput) -> None:
        """Logprobs as vLLM's ``dict[int, Logprob]`` (offline_compat.TokenLogprobs)."""
        if self._texts is None:
            self._texts = TokenTexts(self.tokenizer)
        text = self._texts.text
        for comp in out.outputs:
            if comp.logprobs:
                comp.logprobs = vllm_logprobs(comp.logprobs, comp.token_ids, text)  # type: ignore[assignment]
        if out.prompt_logprobs is not None:
            out.prompt_logprobs = vllm_logprobs(out.prompt_logprobs, out.prompt_token_ids, text)  # type: ignore[assignment]


def select_samples(
    outputs: list[CompletionOutput], params: SamplingParams
) -> list[CompletionOutput]:
    """The ``n`` samples to return: all of them (sample order), or with ``best_of > n``
    the ``n`` with the highest cumulative logprob, renumbered 0..n-1. Sets each
    sample's ``cumulative_logprob`` and drops logprobs the caller did not ask for."""
    for comp in outputs:
        if comp.logprobs:
            comp.cumulative_logprob = sum(lp.sampled_logprob for lp in comp.logprobs)
    chosen = outputs
    if len(outputs) > params.n:
        ranked = sorted(outputs, key=lambda c: -(c.cumulative_logprob or 0.0))
        chosen = sorted(ranked[: params.n], key=lambda c: c.index)
        for i, comp in enumerate(chosen):
            comp.index = i
    if params.logprobs is None:
        for comp in chosen:
            comp.logprobs = None
    return chosen
