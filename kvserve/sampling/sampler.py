"""Turn one row of logits per request into one sampled token (and its logprobs).

The model runner calls :class:`Sampler` once per step with the logits of every
request that produces a token this step (``[B, V]``, fp32, any device) and one
:class:`SamplingRequestState` per row. The math is vectorized over the batch; only
building the small per-row parameter tensors and drawing the per-request random
numbers loops over rows.

Order of operations (vLLM V1 semantics):

    raw logits ──▶ logprobs = log_softmax(raw logits)        (reported, see below)
        │
        ├─ token mask (structured outputs; given by the caller, True = allowed):
        │  disallowed tokens get -inf
        ├─ logit_bias: bias added to the listed token ids
        ├─ allowed_token_ids / bad words: other tokens, or a bad word's last token
        │  once the output ends with the rest of it, get -inf
        ├─ min_tokens: stop tokens (and EOS unless ignore_eos) get -inf while
        │  len(output) < min_tokens
        ├─ repetition penalty over prompt + output tokens (HF/vLLM): a seen token's
        │  logit is divided by the penalty when > 0 and multiplied by it when <= 0
        ├─ frequency / presence penalty over output tokens:
        │  logit -= frequency_penalty * count + presence_penalty * (count > 0)
        │
        ├─ greedy rows (temperature < 1e-5): argmax ──────────────────────────┐
        │                                                                      │
        └─ sampled rows: logits / temperature ─▶ min-p ─▶ top-k ─▶ softmax
             ─▶ top-p ─▶ token = inverse CDF at u ~ U[0, 1)  ──────────────────┴─▶ token

Logprobs are the model's own distribution: ``log_softmax`` over the *raw* logits,
before penalties, temperature and truncation. This is vLLM's default
(``logprobs_mode="raw_logprobs"``), so a token's logprob does not depend on the
sampling settings of its request.

Sampling draws one uniform number ``u`` per row and returns the first token whose
cumulative probability exceeds ``u`` (inverse CDF): exact, and far cheaper than one
random number per vocabulary entry. For a request with ``params.seed`` set, ``u``
is a stable 64-bit mix of ``(seed, len(output_token_ids))`` (:func:`seed_uniform`),
computed in pure Python. The draw therefore depends only on the seed, the number
of tokens generated so far and the request's own logits row: not on the other
rows of the batch, nor its position in it, nor on whether the request was
preempted and recomputed, nor on the device's random generator. Unseeded rows
draw ``u`` from the sampler's CPU generator (torch's global generator unless
``Sampler(seed=...)`` is given).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model.kernels.backend import KernelBackend, default_backend
from kvserve.model.kernels.sampling import Sampling
from kvserve.request import SamplingParams
from kvserve.sampling.logits_rules import (
    _apply_frequency_presence_penalties,
    _apply_logit_bias,
    _apply_min_p,
    _apply_min_tokens,
    _apply_repetition_penalty,
    _apply_token_bans,
    _apply_top_k,
    _apply_top_p,
    _native_rows,
)
from kvserve.sampling.sampling_state import SamplingRequestState as SamplingRequestState
from kvserve.sched.output import Logprobs
from kvserve.seeding import splitmix64

# Temperatures below this are treated as greedy (dividing by them would overflow).
_SAMPLING_EPS = 1e-5


@dataclass
class SamplerOutput:
    """Per row of the input batch, in the same order.

    ``logprobs[i]`` is None unless ``states[i].params.logprobs`` is set; with
    ``logprobs=0`` it holds only the sampled token's logprob (empty top lists).
    """

    token_ids: list[int]
    logprobs: list[Logprobs | None]


def is_sampled(params: SamplingParams) -> bool:
    """Whether a request's rows are sampled (temperature above the greedy threshold)."""
    return params.temperature >= _SAMPLING_EPS


def seed_uniform(seed: int, step: int) -> float:
    """The U[0, 1) number a request with ``seed`` uses for output token number ``step``."""
    return (seed_for_step(seed, step) >> 10) / float(1 << 53)


def seed_for_step(seed: int, step: int) -> int:
    """Stable 63-bit generator seed for draw number ``step`` of a seeded request.

    A splitmix64 finalizer over ``(seed, step)``: nearby seeds and steps give
    unrelated values. Pure Python, so it is the same on every platform.
    """
    return splitmix64(seed, step + 1, 0xD1B54A32D192ED03)


class Sampler:
    """Sample one token per logits row; see the module docstring for the rules.

    ``seed`` (optional) seeds a private CPU generator used for rows whose request
    has no seed of its own; without it those rows use torch's global CPU generator.
    The sampler keeps no per-request state: everything comes from the states.
    """

    def __init__(self, *, seed: int | None = None, kernels: KernelBackend | None = None) -> None:
        # the backend's sampling family (``kernels`` default: default_backend()); None: torch
        self._sampling: Sampling | None = (kernels or default_backend()).sampling
        self._generator: torch.Generator | None = None  # None: torch's global CPU generator
        if seed is not None:
            self._generator = torch.Generator()
            self._generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        states: list[SamplingRequestState],
        token_mask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample from ``logits`` (``[B, V]``, one row per state). Does not modify
        ``logits``. ``token_mask`` (``[B, V]`` bool, True = allowed; e.g. a grammar's)
        is applied as given; if a row's other rules (min_tokens) then leave nothing,
        that row falls back to the mask alone."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match {len(states)} states: "
                "pass a [num_states, vocab_size] tensor, e.g. torch.zeros(len(states), V)"
            )
        if not states:
            return SamplerOutput(token_ids=[], logprobs=[])
        params = [s.params for s in states]
        need_logprobs = any(p.logprobs is not None for p in params)
        need_min_tokens = any(len(s.output_token_ids) < s.params.min_tokens for s in states)
        need_rep = any(p.repetition_penalty != 1.0 for p in params)
        need_freq_pres = any(
            p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params
        )
        need_bias = any(p.logit_bias for p in params)
        need_bans = any(p.allowed_token_ids or p.bad_words_token_ids for p in params)
        is_greedy = [p.temperature < _SAMPLING_EPS for p in params]

        # Fast path: argmax of the raw logits.
        if (
            all(is_greedy)
            and token_mask is None
            and not (need_logprobs or need_min_tokens or need_rep or need_freq_pres or need_bias)
            and not need_bans
        ):
            return SamplerOutput(
                token_ids=_argmax(logits, self._sampling).tolist(), logprobs=[None] * len(states)
            )

        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if need_logprobs else None
        logits = _apply_rules(logits, states, token_mask)

        if all(is_greedy):
            sampled = _argmax(logits, self._sampling)  # [B]
        else:
            sampled = self._sample(logits, states, is_greedy)

        token_ids: list[int] = sampled.tolist()
        logprobs: list[Logprobs | None] = [None] * len(states)
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, sampled, params)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def distributions(
        self,
        logits: torch.Tensor,
        states: list[SamplingRequestState],
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The distribution each row of :meth:`__call__` draws from (``[B, V]`` fp32,
        rows sum to 1): the same rules, temperature and truncations; a greedy row is
        one-hot at its argmax. Speculative rejection sampling compares these (target
        and draft); they must be exactly what the rows would be sampled from."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match {len(states)} states"
            )
        logits = _apply_rules(logits, states, token_mask)
        params = [s.params for s in states]
        is_greedy = [p.temperature < _SAMPLING_EPS for p in params]
        vocab_size = logits.shape[1]
        temps = torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(is_greedy, params, strict=True)],
            dtype=logits.dtype,
            device=logits.device,
        )
        logits = logits / temps.unsqueeze(1)
        min_ps = [0.0 if g else p.min_p for g, p in zip(is_greedy, params, strict=True)]
        if any(m > 0.0 for m in min_ps):
            logits = _apply_min_p(logits, torch.tensor(min_ps, dtype=logits.dtype))
        top_ks = [
            p.top_k if (not g and 0 < p.top_k < vocab_size) else vocab_size
            for g, p in zip(is_greedy, params, strict=True)
        ]
        if any(k < vocab_size for k in top_ks):
            logits = _apply_top_k(logits, torch.tensor(top_ks, device=logits.device))
        probs = torch.softmax(logits, dim=-1)
        top_ps = [1.0 if g else p.top_p for g, p in zip(is_greedy, params, strict=True)]
        if any(p < 1.0 for p in top_ps):
            top_p = torch.tensor(top_ps, dtype=probs.dtype, device=probs.device)
            probs = _apply_top_p(probs, top_p, self._sampling)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        if any(is_greedy):
            rows = torch.tensor([i for i, g in enumerate(is_greedy) if g], dtype=torch.long)
            hot = torch.zeros(len(rows), vocab_size, dtype=probs.dtype, device=probs.device)
            hot.scatter_(1, _argmax(logits[rows], self._sampling).view(-1, 1).long(), 1.0)
            probs[rows] = hot
        return probs

    # -- sampling ---------------------------------------------------------------------

    def _sample(
        self, logits: torch.Tensor, states: list[SamplingRequestState], is_greedy: list[bool]
    ) -> torch.Tensor:
        """Sampled token per row (``[B]``); greedy rows take the argmax of ``logits``."""
        device = logits.device
        vocab_size = logits.shape[1]
        params = [s.params for s in states]
        greedy_mask = torch.tensor(is_greedy, device=device)  # [B]
        greedy_tokens = _argmax(logits, self._sampling) if any(is_greedy) else None  # [B]

        # Greedy rows get temperature 1 and no truncation; their sample is discarded.
        temps = torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(is_greedy, params, strict=True)],
            device=device,
            dtype=logits.dtype,
        )
        min_ps = [0.0 if g else p.min_p for g, p in zip(is_greedy, params, strict=True)]
        top_ks = [
            p.top_k if (not g and 0 < p.top_k < vocab_size) else vocab_size
            for g, p in zip(is_greedy, params, strict=True)
        ]
        truncate = any(m > 0.0 for m in min_ps) or any(k < vocab_size for k in top_ks)
        kernel = self._sampling if _native_rows(logits) else None
        if kernel is not None and not truncate:  # temperature and softmax in one pass
            probs = kernel.softmax_rows(logits.contiguous(), 1.0 / temps)
        else:
            logits = logits / temps.unsqueeze(1)  # [B, V]
            if any(m > 0.0 for m in min_ps):
                min_p = torch.tensor(min_ps, device=device, dtype=logits.dtype)
                logits = _apply_min_p(logits, min_p)
            if any(k < vocab_size for k in top_ks):
                logits = _apply_top_k(logits, torch.tensor(top_ks, device=device))
            probs = torch.softmax(logits, dim=-1)  # [B, V]
        top_ps = [1.0 if g else p.top_p for g, p in zip(is_greedy, params, strict=True)]
        top_p = torch.tensor(top_ps, device=device, dtype=probs.dtype)
        uniforms = self._uniforms(states, is_greedy)
        kernel = self._sampling if _native_rows(probs) else None
        if kernel is not None:  # nucleus selection and the draw in two passes per row
            probs = probs.contiguous()
            if any(p < 1.0 for p in top_ps):
                threshold = kernel.top_p_threshold(probs, top_p)
            else:
                threshold = torch.zeros(len(states))
            random_tokens = kernel.sample_rows(probs, threshold, uniforms)
        else:
            if any(p < 1.0 for p in top_ps):
                probs = _apply_top_p(probs, top_p)
            uniforms = uniforms.to(device=device, dtype=probs.dtype)
            random_tokens = _inverse_cdf_sample(probs, uniforms)  # [B]
        if greedy_tokens is None:
            return random_tokens
        return torch.where(greedy_mask, greedy_tokens, random_tokens)

    def _uniforms(self, states: list[SamplingRequestState], is_greedy: list[bool]) -> torch.Tensor:
        """One U[0, 1) number per row (``[B]`` float64, CPU); greedy rows get 0.

        Seeded rows: from :func:`seed_for_step` alone, so the draw depends only on
        (seed, number of output tokens). Unseeded rows: the sampler's generator.
        """
        values = [
            seed_uniform(s.params.seed, len(s.output_token_ids))
            if not g and s.params.seed is not None
            else 0.0
            for s, g in zip(states, is_greedy, strict=True)
        ]
        u = torch.tensor(values, dtype=torch.float64)
        unseeded = [
            i
            for i, (s, g) in enumerate(zip(states, is_greedy, strict=True))
            if not g and s.params.seed is None
        ]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, generator=self._generator)
        return u


def _apply_rules(
    logits: torch.Tensor, states: list[SamplingRequestState], token_mask: torch.Tensor | None
) -> torch.Tensor:
    """The logits rules before temperature, in the module docstring's order, on a
    private float copy (``logits`` is not modified): token mask, logit bias, bans,
    ``min_tokens`` (falling back to the mask alone if nothing is left), penalties."""
    params = [s.params for s in states]
    need_min_tokens = any(len(s.output_token_ids) < s.params.min_tokens for s in states)
    need_rep = any(p.repetition_penalty != 1.0 for p in params)
    need_freq_pres = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
    need_bias = any(p.logit_bias for p in params)
    need_bans = any(p.allowed_token_ids or p.bad_words_token_ids for p in params)
    logits = logits.float()  # [B, V]
    masked: torch.Tensor | None = None
    if token_mask is not None:
        masked = logits.masked_fill(~token_mask, float("-inf"))  # a private copy
        logits = masked
    if (need_min_tokens or need_rep or need_freq_pres or need_bias or need_bans) and masked is None:
        logits = logits.clone()  # the rules below work in place on a private copy
    if need_bias:
        _apply_logit_bias(logits, states)
    if need_bans:
        _apply_token_bans(logits, states)
    if need_min_tokens:
        logits = logits.clone() if masked is logits else logits
        _apply_min_tokens(logits, states)
        if masked is not None:
            dead = torch.isneginf(logits.amax(dim=-1))  # [B]: nothing left
            if bool(dead.any()):
                logits[dead] = masked[dead]
    if need_rep:
        _apply_repetition_penalty(logits, states)
    if need_freq_pres:
        _apply_frequency_presence_penalties(logits, states)
    return logits


# -- drawing ---------------------------------------------------------------------------


def _argmax(logits: torch.Tensor, sampling: Sampling | None) -> torch.Tensor:
    """``logits.argmax(-1)`` ([B]); ``sampling``'s row kernel on CPU fp32 (torch's is slow)."""
    kernel = sampling if _native_rows(logits) else None
    if kernel is None:
        return logits.argmax(dim=-1)
    return kernel.argmax_rows(logits.contiguous())


def _inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token per row drawn from ``probs`` (``[B, V]``, unnormalized, >= 0) with ``uniforms`` [B].

    The token is the first index whose cumulative mass exceeds ``u * total``;
    a zero-probability token is never returned.
    """
    cdf = probs.cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:].contiguous()  # [B, 1]
    tokens = torch.searchsorted(cdf, uniforms.unsqueeze(1) * total, right=True)  # [B, 1]
    # u * total can round up to total; the first index reaching total has mass > 0.
    last = torch.searchsorted(cdf, total, right=False)  # [B, 1]
    return torch.minimum(tokens, last).squeeze(1)


def _gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, params: list[SamplingParams]
) -> list[Logprobs | None]:
    """Sampled-token logprob and the top-N (``params.logprobs``) per row that asked."""
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()  # [B]
    max_n = max((p.logprobs or 0) for p in params)
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    if max_n > 0:
        values, indices = raw_logprobs.topk(max_n, dim=-1)  # [B, max_n]
        top_ids = indices.tolist()
        top_lps = values.tolist()
    out: list[Logprobs | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        n = p.logprobs
        out.append(
            Logprobs(
                sampled_logprob=sampled_lp[i],
                top_token_ids=top_ids[i][:n] if n else [],
                top_logprobs=top_lps[i][:n] if n else [],
            )
        )
    return out
