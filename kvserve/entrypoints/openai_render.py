"""What OpenAI's completion and chat responses look like, one renderer per endpoint.

``openai_serving`` owns the one streaming skeleton (envelope, usage chunk,
``[DONE]``, errors); a renderer only shapes the per-choice parts:

- completion: choices ``{"index", "text", "logprobs": {"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}, "finish_reason", "stop_reason"}``, object
  ``text_completion`` (also for chunks); with ``echo`` the prompt text comes first.
- chat: choices ``{"index", "message": {"role": "assistant", "content", "refusal"},
  "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs"}],
  "refusal"}, "finish_reason", "stop_reason"}``, object ``chat.completion``; chunks
  (``chat.completion.chunk``) carry ``"delta"`` and open with the assistant role.

Rules for callers: give a renderer the deltas of each choice in order, each once
(:meth:`Renderer.chunk` keeps per-choice text offsets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.engine.outputs import RequestDelta
from kvserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvserve.entrypoints.token_texts import TokenTexts
from kvserve.request import FinishReason
from kvserve.sched.output import Logprobs


@dataclass
class Choice:
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


def usage(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(c.num_prompt_tokens for c in choices)
    completion = sum(c.num_output_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in choices)},
    }


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


class CompletionRenderer:
    response_object = chunk_object = "text_completion"

    def __init__(
        self, req: CompletionRequest, token_texts: TokenTexts, echo: list[str], num_choices: int
    ) -> None:
        self.req = req
        self.token_texts = token_texts
        self.echo = echo
        self._offsets = [0] * num_choices

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return [
            {"index": i, "text": text, "logprobs": None, "finish_reason": None}
            for i, text in enumerate(self.echo)
        ]

    def chunk(self, index: int, delta: RequestDelta) -> dict[str, Any] | None:
        if not (delta.new_text or delta.finished or delta.new_token_ids):
            return None
        lp = None
        if self.req.logprobs is not None:
            lp = self.logprobs(delta.new_token_ids, delta.new_logprobs, self._offsets[index])
            self._offsets[index] += sum(len(t) for t in lp["tokens"])
        elif not delta.new_text and not delta.finished:
            return None
        return {
            "index": index,
            "text": delta.new_text,
            "logprobs": lp,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def choice(self, choice: Choice) -> dict[str, Any]:
        lp = None
        if self.req.logprobs is not None:
            lp = self.logprobs(choice.token_ids, choice.logprobs, 0)
        return {
            "index": choice.index,
            "text": (self.echo[choice.index] if self.echo else "") + choice.text,
            "logprobs": lp,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def logprobs(
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


class ChatRenderer:
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, req: ChatCompletionRequest, token_texts: TokenTexts) -> None:
        self.req = req
        self.token_texts = token_texts
        self.num_top = req.top_logprobs or 0

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
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
        if not (delta.new_text or delta.finished or lp):
            return None
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"content": delta.new_text} if delta.new_text or lp else {},
            "logprobs": lp,
            "finish_reason": delta.finish_reason,
        }
        if delta.finished:
            choice["stop_reason"] = delta.stop_reason
        return choice

    def choice(self, choice: Choice) -> dict[str, Any]:
        lp = self.logprobs(choice.token_ids, choice.logprobs) if self.req.logprobs else None
        return {
            "index": choice.index,
            "message": {"role": "assistant", "content": choice.text, "refusal": None},
            "logprobs": lp,
            "finish_reason": choice.finish_reason,
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
