"""vLLM's offline shapes on kvserve's ``LLM``: prompt dicts, chat content parts,
and logprobs as ``dict[int, Logprob]``.

- Prompts: anywhere ``LLM.generate`` takes a prompt it takes a string, vLLM's
  ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}`` (a list may mix them).
- Chat messages: ``content`` may be a list of ``{"type": "text", "text": ...}``
  parts (joined); an image or audio part is a ValueError saying so.
- Logprobs: each generated position is a :class:`TokenLogprobs`, a
  ``dict[token_id, Logprob]`` holding the sampled token and the top-k (vLLM's
  shape: ``logprob``, ``rank``, ``decoded_token``), which also keeps kvserve's
  attributes (``sampled_logprob``, ``top_token_ids``, ``top_logprobs``, ``rank``)
  so code written for either reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.sched.output import Logprobs


@dataclass
class Logprob:
    """vLLM's ``Logprob``: the token's logprob, its rank (1 = most likely; None
    when the sampled token is outside the top-k and its rank is not computed) and
    its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class TokenLogprobs(dict[int, Logprob]):
    """One position's logprobs in vLLM's shape, with kvserve's fields kept."""

    sampled_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int | None

    @classmethod
    def build(cls, lp: Logprobs, token_id: int, text: Callable[[int], str] | None) -> TokenLogprobs:
        out = cls()
        out.sampled_logprob = lp.sampled_logprob
        out.top_token_ids = list(lp.top_token_ids)
        out.top_logprobs = list(lp.top_logprobs)
        rank = lp.rank
        if rank is None and token_id in lp.top_token_ids:
            rank = lp.top_token_ids.index(token_id) + 1
        out.rank = rank
        out[token_id] = Logprob(lp.sampled_logprob, rank, text(token_id) if text else None)
        for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=False)):
            if t not in out:
                out[t] = Logprob(v, r + 1, text(t) if text else None)
        return out


def vllm_logprobs(
    entries: Sequence[Logprobs | None], token_ids: Sequence[int], text: Callable[[int], str]
) -> list[TokenLogprobs | None]:
    return [
        None if lp is None else TokenLogprobs.build(lp, t, text)
        for lp, t in zip(entries, token_ids, strict=False)
    ]


def split_prompts(prompts: Any) -> list[tuple[str | None, list[int] | None]]:
    """``generate``'s prompts as (text, token ids) pairs, one set. Raises ValueError
    naming the prompt for anything else."""
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    out: list[tuple[str | None, list[int] | None]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append((p, None))
            continue
        if isinstance(p, dict):
            unknown = set(p) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(
                    f"prompt {i} has {sorted(unknown)}: kvserve reads only 'prompt' or "
                    "'prompt_token_ids' (text models; no multi_modal_data)"
                )
            if ("prompt" in p) == ("prompt_token_ids" in p):
                raise ValueError(
                    f"prompt {i}: give exactly one of 'prompt' (text) or 'prompt_token_ids'"
                )
            if "prompt" in p:
                if not isinstance(p["prompt"], str):
                    raise ValueError(f"prompt {i}: 'prompt' must be a string")
                out.append((p["prompt"], None))
            else:
                ids = p["prompt_token_ids"]
                if not isinstance(ids, list | tuple) or not all(type(t) is int for t in ids):
                    raise ValueError(f"prompt {i}: 'prompt_token_ids' must be a list of ints")
                out.append((None, list(ids)))
            continue
        raise ValueError(
            f"prompt {i} is a {type(p).__name__}: use a string, {{'prompt': ...}} or "
            "{'prompt_token_ids': [...]} (or prompt_token_ids=)"
        )
    return out


def chat_message(message: Any, where: str) -> dict[str, Any]:
    """A chat message with list content joined into text (other fields kept)."""
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be a dict such as {{'role': 'user', 'content': 'Hi'}}")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"{where}.content[{j}] is a {kind!r} part: kvserve serves text models, "
                    "send {'type': 'text', 'text': ...} parts only"
                )
        message = {**message, "content": "".join(texts)}
    return message
