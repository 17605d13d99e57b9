"""The model runner's speculative-decoding front: one proposer behind the
:class:`~kvserve.spec_decode.protocol.Proposer` protocol plus the controller that
sizes each proposal.

Rules for the runner: after sampling a step, call :meth:`SpecDecoder.propose` with the
requests that sampled (their histories already hold the new tokens) and return the
result in ``ModelRunnerOutput.spec_token_ids``; call :meth:`observe` for every
verified draft and :meth:`drop` for ``finished_req_ids``. Requests with structured
outputs get no proposals (their grammar would have to advance through drafts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.controller import SpecController
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.protocol import Proposer


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
    """Proposer + controller, built from a :class:`SpeculativeConfig`."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
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

    def propose(
        self, req_ids: Sequence[str], histories: Sequence[Sequence[int]]
    ) -> dict[str, list[int]]:
        """Proposals for the next step of ``req_ids`` (empty ones left out)."""
        if not req_ids:
            return {}
        plan = self.controller.plan(req_ids)
        if not any(plan):
            return {}
        drafts = self.proposer.propose(req_ids, histories, plan)
        return {r: d for r, d in zip(req_ids, drafts, strict=True) if d}

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self.controller.observe(req_id, num_drafts, num_accepted)

    def drop(self, req_id: str) -> None:
        self.controller.drop(req_id)
        self.proposer.drop(req_id)
