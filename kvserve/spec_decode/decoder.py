"""The model runner's speculative-decoding front: one proposer behind the
:class:`~kvserve.spec_decode.protocol.Proposer` protocol plus the controller that
sizes each proposal.

Rules for the runner: call :meth:`SpecDecoder.attach_target` once with its KV cache; call :meth:`SpecDecoder.begin_step` first thing in every step
(it times the step for the gain monitor, :mod:`kvserve.spec_decode.gain`); after
sampling, call :meth:`SpecDecoder.propose` with the requests that sampled (their histories already hold the new tokens) and return the
result in ``ModelRunnerOutput.spec_token_ids``; call :meth:`observe` for every
verified draft and :meth:`drop` for ``finished_req_ids``. Requests with structured
outputs get no proposals (their grammar would have to advance through drafts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, overload

import torch

from kvserve.sampling.sampler import SamplingRequestState
from kvserve.spec_decode.controller import SpecController
from kvserve.spec_decode.gain import GainMonitor
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.protocol import Proposer
from kvserve.speculative_config import SpeculativeConfig

# A catch-up starts only if the remaining output saves this many times its cost
# (measurements on a loaded machine are noisy; a refused catch-up costs nothing).
CATCH_UP_MARGIN = 1.5


class History(Sequence[int]):
    """``prompt + outputs`` as one read-only sequence, without copying either."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt = prompt
        self.output = output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> Any:
        p = len(self.prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            if stop <= p:
                return self.prompt[start:stop]
            if start >= p:
                return self.output[start - p : stop - p]
            return self.prompt[start:] + self.output[: stop - p]
        if i < 0:
            i += len(self)
        return self.prompt[i] if i < p else self.output[i - p]


class SpecDecoder:
    """Proposer + controller + gain monitor, built from a :class:`SpeculativeConfig`.

    ``clock`` (seconds; default ``time.perf_counter``) times the steps; tests inject
    one. With ``adaptive=False`` the monitor is bypassed (fixed ``k``, for measuring)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        if proposer is None:
            if config.method != "ngram":
                raise ValueError(
                    f"SpecDecoder: method {config.method!r} needs its proposer passed in "
                    "(the model runner builds the draft model)"
                )
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.proposer = proposer
        self.controller = SpecController(
            config.num_speculative_tokens,
            step_cost_per_token=config.step_cost_per_token,
            adaptive=config.adaptive,
            disable_by_batch_size=config.disable_by_batch_size,
            draft_step_cost=proposer.step_cost,
        )
        self.gain = GainMonitor()
        self.clock = clock
        self._step_start: float | None = None  # None: not a pure decode step
        self._step_batch = 0
        self._step_verified = False
        self._step_accepted = 0
        self._last_propose_time = 0.0  # the propose call whose drafts the next step verifies
        self._last_forwards = 0
        # engine-wide decayed acceptance (prior 0.6 over 2 positions, as per request)
        self._alpha_num, self._alpha_den = 1.2, 2.0

    def attach_target(
        self, kv_cache: torch.Tensor, block_ids_of: Callable[[str], Sequence[int] | None]
    ) -> bool:
        """Offer the target's KV cache to the proposer (a draft model with the
        target's checkpoint copies K/V rows from it instead of prefilling; see
        :meth:`DraftModelProposer.attach_target`). Returns whether it is used."""
        attach = getattr(self.proposer, "attach_target", None)
        return bool(attach(kv_cache, block_ids_of)) if attach is not None else False

    def begin_step(self, so: Any) -> None:
        """Start timing a step (``so``: its SchedulerOutput). Only pure decode steps,
        one token plus drafts per request and no new requests, are measured."""
        drafts = so.scheduled_spec_decode_tokens
        n = len(so.num_scheduled_tokens)
        pure = (
            n > 0
            and not so.scheduled_new_reqs
            and not so.forks
            and so.total_num_scheduled_tokens == n + sum(len(d) for d in drafts.values())
        )
        self._step_start = self.clock() if pure else None
        self._step_batch = n
        self._step_verified = bool(drafts)
        self._step_accepted = 0

    def _record_step(self) -> None:
        if self._step_start is not None:
            self.gain.record(
                self._step_batch,
                tokens=self._step_batch + self._step_accepted,
                target_time=self.clock() - self._step_start,
                propose_time=self._last_propose_time,
                num_forwards=self._last_forwards,
                verified=self._step_verified,
            )
        self._step_start = None

    def propose(
        self,
        req_ids: Sequence[str],
        histories: Sequence[Sequence[int]],
        states: Sequence[SamplingRequestState | None] | None = None,
    ) -> dict[str, list[int]]:
        """Proposals for the next step of ``req_ids`` (empty ones left out);
        ``states``: their sampling states (a draft model samples for sampled ones)."""
        self._record_step()
        self._last_propose_time, self._last_forwards = 0.0, 0
        if not req_ids:
            return {}
        batch = len(req_ids)
        if self.config.adaptive:
            if not self.gain.allow(batch):
                return {}
            if self.proposer.step_cost > 0:
                measured = self.gain.draft_forward_cost(batch)
                if measured is not None:  # in the controller's unit: a step's fixed cost
                    rho = self.controller.rho
                    self.controller.draft_step_cost = measured * (1.0 + rho * batch)
        plan = self.controller.plan(req_ids)
        if self.config.adaptive and hasattr(self.proposer, "catch_up_tokens"):
            self._refuse_unpaid_catch_ups(req_ids, histories, states, plan)
        if not any(plan):
            return {}
        t0 = self.clock()
        drafts = self.proposer.propose(req_ids, histories, plan, states)
        out = {r: d for r, d in zip(req_ids, drafts, strict=True) if d}
        catch_up = float(getattr(self.proposer, "last_catch_up_time", 0.0))
        if out:  # a call that only caught draft KV up (one-off, per request) is not charged
            spent = self.clock() - t0 - catch_up
            self._last_propose_time = max(spent, 1e-9)
            self._last_forwards = (
                max(len(d) for d in out.values()) if self.proposer.step_cost > 0 else 1
            )
        return out

    def _refuse_unpaid_catch_ups(
        self,
        req_ids: Sequence[str],
        histories: Sequence[Sequence[int]],
        states: Sequence[SamplingRequestState | None] | None,
        plan: list[int],
    ) -> None:
        """Set ``plan[i] = 0`` for every request whose draft catch-up (the prefill of
        what the draft has not seen) would cost more than speculation can save it
        over its remaining output (the payback rule)::

            start (or go on with) the catch-up of L tokens only if
                R * (P / B) * (1 - 1 / g)  >=  CATCH_UP_MARGIN * L * p

        ``R``: the request's remaining output tokens (``max_tokens``; else the
        model's length); ``P``: the measured plain step of ``B`` decodes (the
        batch shares each step's time, so a request saves ``P / B`` per token of
        gain); ``g``: the bucket's measured gain (:meth:`GainMonitor.last_gain`),
        else the nearest smaller bucket's, else the cost model's estimate;
        ``p``: the measured draft prefill seconds per token. Nothing measured yet:
        ``P`` unknown refuses (the next plain step measures it), ``p`` unknown
        allows (the first chunk measures it). Decided again every call, so a
        catch-up stops once it no longer pays."""
        prop = self.proposer
        p = prop.prefill_seconds_per_token()  # type: ignore[attr-defined]
        batch = len(req_ids)
        step = self.gain.plain_step_time(batch)
        g = self._expected_gain(batch, max(plan) if plan else 0)
        max_len = int(getattr(prop, "max_model_len", 1 << 30))
        for i, (req_id, history) in enumerate(zip(req_ids, histories, strict=True)):
            if not plan[i]:
                continue
            lag = prop.catch_up_tokens(req_id, history)  # type: ignore[attr-defined]
            if lag <= 0 or p is None:
                continue
            if step is None or g <= 1.0:
                plan[i] = 0
                continue
            st = states[i] if states is not None else None
            max_tokens = st.params.max_tokens if st is not None else None
            remaining = (
                max_tokens - len(st.output_token_ids)
                if st is not None and max_tokens is not None
                else max_len - len(history)
            )
            if remaining * (step / batch) * (1.0 - 1.0 / g) < CATCH_UP_MARGIN * lag * p:
                plan[i] = 0

    def _expected_gain(self, batch: int, k: int) -> float:
        """Measured gain of ``batch``'s bucket (or its last one), else the nearest
        smaller measured bucket's, else the controller's cost model: ``k`` drafts
        at the engine's acceptance, over a step with ``k`` draft forwards and rows."""
        g = self.gain.last_gain(batch)
        b = batch - 1
        while g is None and b >= 1:
            g = self.gain.last_gain(b)
            b -= 1
        if g is not None:
            return g
        if k <= 0:
            return 1.0
        a = self._alpha_num / self._alpha_den
        rho, fwd = self.controller.rho, self.controller.draft_step_cost
        plain = 1.0 + rho * batch
        return sum(a**i for i in range(k + 1)) / ((plain + k * fwd + rho * k * batch) / plain)

    def draft_probs(self, req_id: str, drafts: Sequence[int]) -> torch.Tensor | None:
        """The draft distributions of ``drafts`` (sampled drafts), else None."""
        return self.proposer.draft_probs(req_id, drafts)

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self._step_accepted += max(0, num_accepted)
        if num_drafts > 0:  # engine-wide acceptance, for the catch-up's gain estimate
            attempts = num_accepted + (1 if num_accepted < num_drafts else 0)
            self._alpha_num = 0.9 * self._alpha_num + num_accepted
            self._alpha_den = 0.9 * self._alpha_den + attempts
            self.controller.prior_alpha = self._alpha_num / self._alpha_den
        self.controller.observe(req_id, num_drafts, num_accepted)

    def drop(self, req_id: str) -> None:
        self.controller.drop(req_id)
        self.proposer.drop(req_id)
