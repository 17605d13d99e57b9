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

from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.controller import SpecController
from kvserve.spec_decode.gain import GainMonitor
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.protocol import Proposer
from kvserve.worker.sampler import SamplingRequestState


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
        if not any(plan):
            return {}
        t0 = self.clock()
        drafts = self.proposer.propose(req_ids, histories, plan, states)
        out = {r: d for r, d in zip(req_ids, drafts, strict=True) if d}
        catch_up = float(getattr(self.proposer, "last_catch_up_time", 0.0))
        self.gain.charge(batch, catch_up)  # one-off: on the spec side, no tokens
        if out:  # a call that only caught draft KV up (one-off, per request) is not charged
            spent = self.clock() - t0 - catch_up
            self._last_propose_time = max(spent, 1e-9)
            self._last_forwards = (
                max(len(d) for d in out.values()) if self.proposer.step_cost > 0 else 1
            )
        return out

    def draft_probs(self, req_id: str, drafts: Sequence[int]) -> torch.Tensor | None:
        """The draft distributions of ``drafts`` (sampled drafts), else None."""
        return self.proposer.draft_probs(req_id, drafts)

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self._step_accepted += max(0, num_accepted)
        self.controller.observe(req_id, num_drafts, num_accepted)

    def drop(self, req_id: str) -> None:
        self.controller.drop(req_id)
        self.proposer.drop(req_id)
