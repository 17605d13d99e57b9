"""The sampler's logits rules, one function per rule (kvserve.sampling.sampler applies
them in its documented order): logit bias, token bans, ``min_tokens``, repetition /
frequency / presence penalties, and the truncations min-p, top-k, top-p.

Every ``_apply_*`` function either works in place on a private copy the caller made
(bias, bans, min_tokens, penalties) or returns a new tensor (min-p, top-k, top-p);
none keeps state. Rows are independent: a row's result depends on its logits and its
own request state only.
"""

from __future__ import annotations

import torch

from kvserve.model.kernels.sampling import Sampling
from kvserve.sampling.sampling_state import SamplingRequestState

# Top-p looks at this many most likely tokens before sorting a whole row.
_TOP_P_CANDIDATES = (256, 4096)


def _native_rows(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.numel() > 0


def _padded_ids(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """``[R, max_len]`` int64 ids, right-padded with ``pad`` (at least one column)."""
    width = max(1, max((len(r) for r in rows), default=0))
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[R, V]`` count of each token id per row (ids outside ``[0, V)`` are ignored)."""
    ids = _padded_ids(rows, vocab_size, device)  # [R, L]; pad = V, an extra column
    ids = torch.where((ids >= 0) & (ids <= vocab_size), ids, vocab_size)
    counts = torch.zeros(len(rows), vocab_size + 1, device=device, dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _apply_logit_bias(logits: torch.Tensor, states: list[SamplingRequestState]) -> None:
    """Add each row's ``logit_bias`` (token id -> bias) in place; ids past the
    vocabulary are ignored (the engine refuses them)."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, s in enumerate(states):
        for tok, bias in (s.params.logit_bias or {}).items():
            if 0 <= tok < vocab_size:
                rows.append(i)
                cols.append(tok)
                values.append(float(bias))
    if rows:
        device = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
            torch.tensor(values, device=device, dtype=logits.dtype),
            accumulate=True,
        )


def _apply_token_bans(logits: torch.Tensor, states: list[SamplingRequestState]) -> None:
    """``allowed_token_ids``: every other token gets -inf; ``bad_words_token_ids``:
    a one-token word is never sampled, a longer one's last token is banned right
    after the output ends with the rest of it (vLLM's rule)."""
    vocab_size = logits.shape[1]
    for i, s in enumerate(states):
        allowed = s.params.allowed_token_ids
        if allowed:
            keep = torch.tensor([t for t in allowed if t < vocab_size], dtype=torch.long)
            row = torch.full((vocab_size,), float("-inf"), dtype=logits.dtype, device=logits.device)
            keep = keep.to(logits.device)
            row[keep] = logits[i, keep]
            logits[i] = row
        for ids in s.params.bad_words_token_ids or ():
            prefix = ids[:-1]
            ends_with_prefix = not prefix or s.output_token_ids[-len(prefix) :] == prefix
            if ends_with_prefix and ids[-1] < vocab_size:
                logits[i, ids[-1]] = float("-inf")


def _apply_min_tokens(logits: torch.Tensor, states: list[SamplingRequestState]) -> None:
    """Forbid stop tokens (and EOS unless ignore_eos) until min_tokens are generated."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        p = s.params
        if len(s.output_token_ids) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids)
        if s.eos_token_id is not None and not p.ignore_eos:
            banned.add(s.eos_token_id)
        for t in banned:
            if 0 <= t < vocab_size:
                rows.append(i)
                cols.append(t)
    if rows:
        logits[
            torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)
        ] = float("-inf")


def _apply_repetition_penalty(logits: torch.Tensor, states: list[SamplingRequestState]) -> None:
    """HF/vLLM repetition penalty over prompt + output tokens, rows with penalty != 1."""
    idx = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    device = logits.device
    vocab_size = logits.shape[1]
    seen = (
        _token_counts(
            [states[i].prompt_token_ids + states[i].output_token_ids for i in idx],
            vocab_size,
            device,
        )
        > 0
    )  # [R, V]
    penalty = torch.tensor(
        [states[i].params.repetition_penalty for i in idx], device=device, dtype=logits.dtype
    ).unsqueeze(1)  # [R, 1]
    rows = torch.tensor(idx, device=device)
    sub = logits[rows]  # [R, V]
    penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[rows] = torch.where(seen, penalized, sub)


def _apply_frequency_presence_penalties(
    logits: torch.Tensor, states: list[SamplingRequestState]
) -> None:
    """``logit -= frequency * count + presence * (count > 0)`` over output tokens."""
    idx = [
        i
        for i, s in enumerate(states)
        if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0
    ]
    device = logits.device
    counts = _token_counts([states[i].output_token_ids for i in idx], logits.shape[1], device)
    freq = torch.tensor(
        [states[i].params.frequency_penalty for i in idx], device=device, dtype=logits.dtype
    ).unsqueeze(1)  # [R, 1]
    pres = torch.tensor(
        [states[i].params.presence_penalty for i in idx], device=device, dtype=logits.dtype
    ).unsqueeze(1)  # [R, 1]
    rows = torch.tensor(idx, device=device)
    logits[rows] = logits[rows] - freq * counts - pres * (counts > 0).to(logits.dtype)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p * max probability`` (``min_p`` [B])."""
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose logit is >= the k-th largest of the row (ties kept).

    ``top_k`` [B]: rows with ``k >= V`` are left untouched.
    """
    vocab_size = logits.shape[1]
    enabled = top_k < vocab_size  # [B]
    max_k = int(top_k[enabled].max())
    top_values = logits.topk(max_k, dim=-1).values  # [B, max_k]
    kth = top_values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))  # [B, 1]
    kth = kth.masked_fill(~enabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(
    probs: torch.Tensor, top_p: torch.Tensor, sampling: Sampling | None = None
) -> torch.Tensor:
    """Zero the tail outside the nucleus; ``probs`` [B, V], ``top_p`` [B] (1 = off).

    Keeps the smallest set of most likely tokens whose probability sum is >= p
    (as vLLM: a token is dropped when the tokens ranked above it already hold >= p
    of the mass); the most likely token always survives, and tokens tied with the
    least likely kept token are kept too. Looks at the top 256, then 4,096
    tokens, and sorts the whole row only for rows whose nucleus is wider still;
    which step decides depends on the row alone.
    """
    kernel = sampling if _native_rows(probs) else None
    if kernel is not None:  # expected O(V) selection per row instead of top-k sorts
        threshold = kernel.top_p_threshold(probs.contiguous(), top_p)
        return probs.masked_fill(probs < threshold.unsqueeze(1), 0.0)
    vocab_size = probs.shape[1]
    threshold = torch.full_like(top_p, float("nan"))  # [B]
    rows = torch.arange(probs.shape[0], device=probs.device)
    for k in (*_TOP_P_CANDIDATES, vocab_size):
        k = min(k, vocab_size)
        threshold[rows] = _top_p_threshold(probs[rows], top_p[rows], k)
        rows = rows[torch.isnan(threshold[rows])]
        if rows.numel() == 0:
            break
    threshold = threshold.masked_fill(top_p >= 1.0, 0.0)
    return probs.masked_fill(probs < threshold.unsqueeze(1), 0.0)


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor, k: int) -> torch.Tensor:
    """Smallest kept probability per row (``[B]``), or NaN when the top ``k`` hold < p."""
    top = probs.topk(k, dim=-1).values  # [B, k], descending
    mass_above = top.cumsum(dim=-1) - top  # [B, k]: mass of the tokens ranked above
    keep = mass_above < top_p.unsqueeze(1)
    keep[:, 0] = True
    num_keep = keep.sum(dim=-1)  # [B], >= 1
    threshold = top.gather(1, (num_keep - 1).unsqueeze(1)).squeeze(1)
    if k < probs.shape[1]:
        # The top k hold < p: the token ranked k+1 would be kept too, look further.
        undecided = (top.sum(dim=-1) < top_p) & (top_p < 1.0)
        threshold = threshold.masked_fill(undecided, float("nan"))
    return threshold
