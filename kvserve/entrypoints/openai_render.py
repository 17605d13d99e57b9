"""What OpenAI's completion and chat responses look like, one renderer per endpoint.

``openai_serving`` owns the one streaming skeleton (envelope, usage chunk,
``[DONE]``, errors); a renderer only shapes the per-choice parts:

- completion: choices ``{"index", "text", "logprobs": {"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}, "finish_reason", "stop_reason"}``, object
  ``text_completion`` (also for chunks); with ``echo`` the prompt text comes first
  (streamed: in each choice's first chunk) and, with ``logprobs``, the prompt tokens
  lead the logprobs, the first with ``null`` logprob and top (OpenAI's legacy shape);
  with ``max_tokens: 0`` only the prompt. vLLM's ``prompt_logprobs`` go on the choice.
- chat: choices ``{"index", "message": {"role": "assistant", "content", "refusal"},
  "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs"}],
  "refusal"}, "finish_reason", "stop_reason"}``, object ``chat.completion``; chunks
  (``chat.completion.chunk``) carry ``"delta"`` and open with the assistant role;
  vLLM's ``prompt_logprobs`` are a top-level field of the response (streamed: of the
  chunk with the choice's first content).

Choice ``index`` is ``prompt * n + sample``; ``usage.prompt_tokens`` counts each
prompt once however many samples it has.

Rules for callers: give a renderer the deltas of each choice in order, each once
(:meth:`Renderer.chunk` keeps per-choice text offsets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.engine.outputs import RequestDelta
from kvserve.entrypoints.chat.tools import ToolOutput
from kvserve.entrypoints.chat_protocol import ChatCompletionRequest
from kvserve.entrypoints.completions_protocol import CompletionRequest
from kvserve.entrypoints.token_texts import TokenTexts
from kvserve.request import FinishReason
from kvserve.sched.output import Logprobs


@dataclass
class Choice:
    """Everything one prompt's stream produced so far."""

    index: int
    prompt_index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.sampled_logprob for lp in self.logprobs)

    def add(self, delta: RequestDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.new_text
        self.token_ids.extend(delta.new_token_ids)
        self.logprobs.extend(delta.new_logprobs)
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_output_tokens = delta.num_output_tokens
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


def usage(choices: list[Choice], *, count_outputs: bool = True) -> dict[str, Any]:
    """Token counts over every sample generated (best_of included); each prompt's
    tokens counted once. ``count_outputs=False`` (echo with max_tokens 0): none."""
    prompts = {c.prompt_index: c for c in choices}
    prompt = sum(c.num_prompt_tokens for c in prompts.values())
    completion = sum(c.num_output_tokens for c in choices) if count_outputs else 0
    cached = sum(c.num_cached_tokens for c in prompts.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def best_choices(choices: list[Choice], n: int) -> list[Choice]:
    """Per prompt, the ``n`` samples with the highest cumulative logprob (best_of),
    in sample order, renumbered ``prompt * n + k``."""
    out: list[Choice] = []
    for p in sorted({c.prompt_index for c in choices}):
        mine = [c for c in choices if c.prompt_index == p]
        best = sorted(mine, key=lambda c: -c.cumulative_logprob)[:n]
        for k, c in enumerate(sorted(best, key=lambda c: c.index)):
            c.index = p * n + k
            out.append(c)
    return out


def vllm_prompt_logprobs(
    token_texts: TokenTexts, prompt_ids: list[int], entries: list[Logprobs | None]
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` for the prompt token and the top k."""
    out: list[dict[str, Any] | None] = []
    for tid, lp in zip(prompt_ids, entries, strict=False):
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(t): {"logprob": _finite(v), "rank": r + 1, "decoded_token": token_texts.text(t)}
            for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=False))
        }
        entry[str(tid)] = {
            "logprob": _finite(lp.sampled_logprob),
            "rank": lp.rank,
            "decoded_token": token_texts.text(tid),
        }
        out.append(entry)
    return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class Renderer(Protocol):
    """The per-endpoint part of a response (see the module docstring)."""

    response_object: str
    chunk_object: str

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """Choices of the chunks sent before any delta."""
        ...

    def chunk(self, index: int, delta: RequestDelta) -> dict[str, Any] | None:
        """The chunk choice for one delta of choice ``index``; None sends nothing."""
        ...

    def choice(self, choice: Choice) -> dict[str, Any]:
        """One choice of the non-streamed response."""
        ...

    def response_fields(self, choices: list[Choice]) -> dict[str, Any]:
        """Top-level fields of the non-streamed response besides the envelope."""
        ...

    def chunk_fields(self, delta: RequestDelta) -> dict[str, Any]:
        """Top-level fields of the chunk rendering ``delta``."""
        ...


class CompletionRenderer:
    """Completion choices; ``echo`` and ``prompt_ids`` are per prompt, choice ``i``
    belongs to prompt ``prompt_index[i]``."""

    response_object = chunk_object = "text_completion"

    def __init__(
        self,
        req: CompletionRequest,
        token_texts: TokenTexts,
        echo: list[str],
        prompt_ids: list[list[int]],
        prompt_index: list[int],
    ) -> None:
        self.req = req
        self.token_texts = token_texts
        self.echo = echo
        self.prompt_ids = prompt_ids
        self.prompt_index = prompt_index
        self.echo_only = req.echo_only
        self._offsets = [0] * len(prompt_index)
        self._started = [False] * len(prompt_index)

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    def response_fields(self, choices: list[Choice]) -> dict[str, Any]:
        return {}

    def chunk_fields(self, delta: RequestDelta) -> dict[str, Any]:
        return {}

    def chunk(self, index: int, delta: RequestDelta) -> dict[str, Any] | None:
        p = self.prompt_index[index]
        first = not self._started[index]
        token_ids, logprobs, text = delta.new_token_ids, delta.new_logprobs, delta.new_text
        if self.echo_only:
            token_ids, logprobs, text = [], [], ""
        if not (text or delta.finished or token_ids or first):
            return None
        self._started[index] = True
        lp = None
        if self.req.logprobs is not None:
            lp = self._legacy(p, first, delta.prompt_logprobs, token_ids, logprobs, index)
        elif not (text or delta.finished or (first and self.echo)):
            return None
        choice: dict[str, Any] = {
            "index": index,
            "text": (self.echo[p] if first and self.echo else "") + text,
            "logprobs": lp,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        if first and self.req.prompt_logprobs is not None and delta.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                self.token_texts, self.prompt_ids[p], delta.prompt_logprobs
            )
        return choice

    def _legacy(
        self,
        p: int,
        with_prompt: bool,
        prompt_lps: list[Logprobs | None] | None,
        token_ids: list[int],
        logprobs: list[Logprobs],
        index: int,
    ) -> dict[str, Any]:
        ids: list[int] = []
        lps: list[Logprobs | None] = []
        if with_prompt and self.echo:
            ids = list(self.prompt_ids[p])
            lps = list(prompt_lps) if prompt_lps is not None else [None] * len(ids)
        ids += token_ids
        lps += logprobs
        out = self.logprobs(ids, lps, self._offsets[index])
        self._offsets[index] += sum(len(t) for t in out["tokens"])
        return out

    def choice(self, choice: Choice) -> dict[str, Any]:
        p = choice.prompt_index
        token_ids, logprobs, text = choice.token_ids, choice.logprobs, choice.text
        if self.echo_only:
            token_ids, logprobs, text = [], [], ""
        lp = None
        if self.req.logprobs is not None:
            ids: list[int] = list(self.prompt_ids[p]) if self.echo else []
            lps: list[Logprobs | None] = []
            if self.echo:
                lps = list(choice.prompt_logprobs or [None] * len(ids))
            lp = self.logprobs(ids + token_ids, lps + list(logprobs), 0)
        out: dict[str, Any] = {
            "index": choice.index,
            "text": (self.echo[p] if self.echo else "") + text,
            "logprobs": lp,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if self.req.prompt_logprobs is not None and choice.prompt_logprobs is not None:
            out["prompt_logprobs"] = vllm_prompt_logprobs(
                self.token_texts, self.prompt_ids[p], choice.prompt_logprobs
            )
        return out

    def logprobs(
        self, token_ids: list[int], logprobs: list[Logprobs | None], offset: int
    ) -> dict[str, Any]:
        """OpenAI's legacy shape; a token without logprobs (the first prompt token)
        gets ``null`` logprob and top."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for tid, lp in zip(token_ids, logprobs, strict=False):
            tok = self.token_texts.text(tid)
            tokens.append(tok)
            offsets.append(offset)
            offset += len(tok)
            if lp is None:
                token_lps.append(None)
                tops.append(None)
                continue
            top = {
                self.token_texts.text(t): _finite(v)
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=False)
            }
            top.setdefault(tok, _finite(lp.sampled_logprob))
            token_lps.append(_finite(lp.sampled_logprob))
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


class ChatRenderer:
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        req: ChatCompletionRequest,
        token_texts: TokenTexts,
        prompt_ids: list[int],
        tools: ToolOutput | None = None,
    ) -> None:
        self.req = req
        self.token_texts = token_texts
        self.num_top = req.top_logprobs or 0
        self.prompt_ids = prompt_ids
        # Function calling (chat/tools.py): parses each choice's text into tool_calls.
        self.tools = tools if tools is not None and tools.active else None
        self._unopened: set[int] = set()  # forced calls: choices whose role is not sent

    def response_fields(self, choices: list[Choice]) -> dict[str, Any]:
        """vLLM's top-level ``prompt_logprobs`` when asked for."""
        if self.req.prompt_logprobs is None:
            return {}
        entries = next((c.prompt_logprobs for c in choices if c.prompt_logprobs), None)
        return {
            "prompt_logprobs": vllm_prompt_logprobs(
                self.token_texts, self.prompt_ids, entries or []
            )
        }

    def chunk_fields(self, delta: RequestDelta) -> dict[str, Any]:
        if self.req.prompt_logprobs is None or delta.prompt_logprobs is None:
            return {}
        return {
            "prompt_logprobs": vllm_prompt_logprobs(
                self.token_texts, self.prompt_ids, delta.prompt_logprobs
            )
        }

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        if self.tools is not None and self.tools.forced:
            # As OpenAI streams a call: the role opens in the call's first chunk
            # ({"role": "assistant", "content": null, "tool_calls": [header]}).
            self._unopened = set(range(num_choices))
            return []
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(num_choices)
        ]

    def chunk(self, index: int, delta: RequestDelta) -> dict[str, Any] | None:
        lp = None
        if self.req.logprobs and delta.new_token_ids:
            lp = self.logprobs(delta.new_token_ids, delta.new_logprobs)
        carries_prompt_lps = self.req.prompt_logprobs is not None and delta.prompt_logprobs
        finish_reason: str | None = delta.finish_reason
        if self.tools is not None:
            body = self.tools.chunk_delta(index, delta.new_text, delta.finished)
            finish_reason = self.tools.finish_reason(index, finish_reason, delta.num_output_tokens)
            if not (body or delta.finished or lp or carries_prompt_lps):
                return None
            if index in self._unopened:
                self._unopened.discard(index)
                body = {"role": "assistant", "content": None, **body}
        else:
            if not (delta.new_text or delta.finished or lp or carries_prompt_lps):
                return None
            body = {"content": delta.new_text} if delta.new_text or lp else {}
        choice: dict[str, Any] = {
            "index": index,
            "delta": body,
            "logprobs": lp,
            "finish_reason": finish_reason,
        }
        if delta.finished:
            choice["stop_reason"] = delta.stop_reason
        return choice

    def choice(self, choice: Choice) -> dict[str, Any]:
        lp = self.logprobs(choice.token_ids, choice.logprobs) if self.req.logprobs else None
        message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
        finish_reason: str | None = choice.finish_reason
        if self.tools is not None:
            content, calls = self.tools.message(choice.index, choice.text)
            message = {"role": "assistant", "content": content, "refusal": None}
            if calls:
                message["tool_calls"] = calls
            finish_reason = self.tools.finish_reason(
                choice.index, finish_reason, choice.num_output_tokens
            )
        return {
            "index": choice.index,
            "message": message,
            "logprobs": lp,
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def logprobs(self, token_ids: list[int], logprobs: list[Logprobs]) -> dict[str, Any]:
        content = []
        for tid, lp in zip(token_ids, logprobs, strict=False):
            tok, raw = self.token_texts.get(tid)
            top = []
            for t, v in list(zip(lp.top_token_ids, lp.top_logprobs, strict=False))[: self.num_top]:
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
