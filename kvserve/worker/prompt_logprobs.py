"""Prompt logprobs: the logprob of every prompt token given the tokens before it.

A request with ``prompt_logprobs=k`` computes its whole prompt (the KV cache manager
gives it no prefix-cache hit: a cached position has KV but no hidden state, and its
logits need the hidden state of the last layer, as in vLLM). For each chunk of the
prompt the model runner scores the chunk's rows whose next token is still in the
prompt::

    prompt:   p0  p1  p2  p3  p4          chunk = positions [2, 5)
    row:              r2  r3  r4
    scores:           p3  p4  --          (p5 is not in the prompt: r4 is sampled)

Each scored row gives a :class:`Logprobs` with the actual next token's logprob, its
rank (1 = most likely) and the top ``k``; logits are fp32 ``log_softmax`` of the raw
logits, the same as the sampled tokens' logprobs. Rows are scored ``ROWS_PER_PASS``
at a time so a long prompt never holds ``[prompt, vocab]`` logits at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.sched.output import Logprobs

ROWS_PER_PASS = 128


@dataclass
class PromptLogprobsRows:
    """Rows of one step to score for one request: rows ``[row, row + count)`` hold
    positions ``[start, start + count)``; ``targets`` the prompt tokens that follow."""

    req_id: str
    row: int
    start: int
    targets: list[int]
    num_top: int


def rows_to_score(
    req_id: str, row: int, start: int, num_tokens: int, prompt: list[int], num_top: int
) -> PromptLogprobsRows | None:
    """The rows of a chunk ``[start, start + num_tokens)`` that score a prompt token,
    or None when there are none (the chunk is past the prompt's last position but one)."""
    count = min(num_tokens, len(prompt) - 1 - start)
    if count <= 0:
        return None
    return PromptLogprobsRows(req_id, row, start, prompt[start + 1 : start + 1 + count], num_top)


def score(
    hidden: torch.Tensor,
    rows: PromptLogprobsRows,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[Logprobs]:
    """One :class:`Logprobs` per scored row, from the step's ``hidden`` ([rows, H])."""
    out: list[Logprobs] = []
    count = len(rows.targets)
    for first in range(0, count, ROWS_PER_PASS):
        n = min(ROWS_PER_PASS, count - first)
        index = torch.arange(rows.row + first, rows.row + first + n, device=hidden.device)
        logprobs = torch.log_softmax(compute_logits(hidden.index_select(0, index)).float(), -1)
        targets = torch.tensor(rows.targets[first : first + n], device=hidden.device)
        target_lp = logprobs.gather(1, targets.unsqueeze(1))  # [n, 1]
        ranks = (logprobs > target_lp).sum(dim=1) + 1  # [n]
        top_ids: list[list[int]] = [[] for _ in range(n)]
        top_lps: list[list[float]] = [[] for _ in range(n)]
        if rows.num_top > 0:
            values, indices = logprobs.topk(rows.num_top, dim=-1)
            top_ids, top_lps = indices.tolist(), values.tolist()
        for lp, rank, ids, lps in zip(
            target_lp.squeeze(1).tolist(), ranks.tolist(), top_ids, top_lps, strict=True
        ):
            out.append(Logprobs(lp, ids, lps, rank=rank))
    return out
