"""How many tokens to propose per request each step: the "never worse" rule.

Cost model (measured, docs/speculative-decoding.md): a step that computes ``N``
tokens takes ``T(N) = w + t*N``; on this CPU ``w`` (reading the weights once) dominates
a decode step, ``rho = t / w`` is ``step_cost_per_token``. A draft token is worth
computing when what it is expected to yield per unit of time is at least what the
step yields on average::

    step without it: G tokens out, T time.  with it: G + v, T + rho
    (G + v) / (T + rho) > G / T   <=>   v > rho * G / T

``v`` for the ``i``-th draft of request ``r`` is ``alpha_r ** i``: the chance that
drafts ``1..i`` are all accepted, with ``alpha_r`` the request's acceptance rate (an
exponentially decayed estimate; a new request starts from ``prior_alpha``, 0.6 until
the decoder sets it to the engine's measured acceptance). The controller adds
draft tokens greedily, most valuable first, while the inequality holds. So:

- per request: a request whose drafts are rejected gets shorter proposals, then none
  (``alpha_r ** 1`` below the threshold); every ``PROBE_EVERY`` plans without a draft
  it gets one probe token (so a request whose text turns repetitive is noticed);
- engine-wide: with ``B`` decodes ``G >= B`` and ``T = 1 + rho*N``, so the threshold
  ``rho*G/T`` rises with the batch (``rho/(1+rho)`` at B = 1, towards 1 when the
  step is compute bound): large batches only keep drafts that are nearly sure.

``disable_by_batch_size`` (vLLM's option) is a hard cap on top: no drafts while more
requests decode. ``adaptive=False`` proposes ``k`` for everyone (for measurements).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PRIOR_ALPHA = 0.6  # acceptance assumed for a request not yet measured
PRIOR_WEIGHT = 2.0  # in positions: how fast measurements override the prior
DECAY = 0.9  # per observation: recent acceptance counts more
PROBE_EVERY = 16


@dataclass
class _ReqAcceptance:
    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    attempts: float = PRIOR_WEIGHT
    idle_plans: int = 0

    @property
    def alpha(self) -> float:
        return self.accepted / self.attempts


class SpecController:
    """Plans draft lengths per request (see the module docstring); keeps per-request
    acceptance. Rules for callers: :meth:`observe` every verified proposal, :meth:`drop`
    finished requests."""

    def __init__(
        self,
        num_speculative_tokens: int,
        *,
        step_cost_per_token: float,
        adaptive: bool = True,
        disable_by_batch_size: int | None = None,
        draft_step_cost: float = 0.0,
    ) -> None:
        """``draft_step_cost``: what one proposing forward costs, in units of the
        target's step (0 for n-gram lookup; a draft model's weight bytes over the
        target's): the ``i``-th draft of any request needs the ``i``-th draft forward,
        which the whole batch shares, so a plan deeper than every other one pays it."""
        self.k = num_speculative_tokens
        self.rho = step_cost_per_token
        self.draft_step_cost = max(0.0, float(draft_step_cost))
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self._reqs: dict[str, _ReqAcceptance] = {}
        # acceptance assumed for a request not yet measured; the decoder sets it to
        # the engine's measured acceptance (a draft model's is the same for all)
        self.prior_alpha = PRIOR_ALPHA

    def alpha(self, req_id: str) -> float:
        """The request's current acceptance estimate."""
        return self._reqs.get(req_id, _ReqAcceptance()).alpha

    def plan(self, req_ids: Sequence[str], num_other_tokens: int = 0) -> list[int]:
        """Draft tokens to propose for each of ``req_ids`` (the requests that will
        decode next step); ``num_other_tokens``: prompt tokens expected in that step."""
        batch = len(req_ids)
        if self.disable_by_batch_size is not None and batch > self.disable_by_batch_size:
            return [0] * batch
        if not self.adaptive:
            return [self.k] * batch
        states = [self._reqs.get(r) or self._new(r) for r in req_ids]
        alphas = [min(s.alpha, 0.999) for s in states]
        candidates = sorted(
            ((alphas[j] ** i, j) for j in range(batch) for i in range(1, self.k + 1)),
            reverse=True,
        )
        plan = [0] * batch
        gain = float(batch)
        time = 1.0 + self.rho * (batch + num_other_tokens)
        if self.draft_step_cost > 0.0:
            self._plan_levels(alphas, plan, gain, time)
        else:
            for value, j in candidates:
                if value * time <= self.rho * gain:
                    break
                plan[j] += 1
                gain += value
                time += self.rho
        for j, s in enumerate(states):
            if plan[j]:
                s.idle_plans = 0
                continue
            s.idle_plans += 1
            if s.idle_plans >= PROBE_EVERY:
                s.idle_plans = 0
                plan[j] = 1
        return plan

    def _new(self, req_id: str) -> _ReqAcceptance:
        s = _ReqAcceptance(accepted=self.prior_alpha * PRIOR_WEIGHT, attempts=PRIOR_WEIGHT)
        self._reqs[req_id] = s
        return s

    def _plan_levels(self, alphas: list[float], plan: list[int], gain: float, time: float) -> None:
        """Draft depths for a proposer whose forwards cost: depth ``d`` costs one
        forward (``draft_step_cost``, shared by the batch) plus ``rho`` per request
        drafted that deep. Each depth takes the most likely requests while the step's
        tokens per unit of time rise, and the depth is kept only if it pays overall."""
        for d in range(1, self.k + 1):
            cands = sorted(
                ((alphas[j] ** d, j) for j in range(len(plan)) if plan[j] == d - 1),
                reverse=True,
            )
            g, t = gain, time + self.draft_step_cost
            best_rate, best_n = gain / time, 0
            for n, (value, _) in enumerate(cands, start=1):
                g, t = g + value, t + self.rho
                if g / t > best_rate:
                    best_rate, best_n = g / t, n
            if best_n == 0:
                return
            for value, j in cands[:best_n]:
                plan[j] += 1
                gain += value
                time += self.rho
            time += self.draft_step_cost

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """Record a verified proposal: ``num_accepted`` of its ``num_drafts`` tokens
        were accepted (in order, so the first rejection ends it)."""
        if num_drafts <= 0:
            return
        s = self._reqs.get(req_id) or self._new(req_id)
        attempts = num_accepted + (1 if num_accepted < num_drafts else 0)
        s.accepted = DECAY * s.accepted + num_accepted
        s.attempts = DECAY * s.attempts + attempts

    def drop(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
