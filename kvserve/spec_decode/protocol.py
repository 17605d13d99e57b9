"""The one interface every proposer implements.

A proposer guesses the next tokens of running requests; the target model then
verifies the guesses in one step (:mod:`kvserve.spec_decode.verify`). Proposers
never change a request: they read its token history and return token ids.

Rules a proposer keeps: ``propose`` returns one list per request, in order, each at
most ``num_tokens[i]`` long (an empty list = no proposal, which costs nothing);
``drop`` forgets a finished or preempted request (called by the model runner for
``finished_req_ids``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvserve.sampling.sampler import SamplingRequestState


class Proposer(Protocol):
    # One proposing forward's cost in units of the target's decode step (0: free, as
    # n-gram lookup); the controller weighs each draft depth against it.
    step_cost: float

    def propose(
        self,
        req_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        num_tokens: Sequence[int],
        states: Sequence[SamplingRequestState | None] | None = None,
    ) -> list[list[int]]:
        """Up to ``num_tokens[i]`` draft tokens that follow ``token_ids[i]`` (the
        request's prompt + outputs) for each request ``req_ids[i]``; ``states[i]``
        (optional) the request's sampling state, for a proposer that samples."""
        ...

    def draft_probs(self, req_id: str, drafts: Sequence[int]) -> torch.Tensor | None:
        """The distributions ``[len(drafts), V]`` that ``drafts`` (a prefix of the last
        proposal for ``req_id``) were sampled from, once; None: fixed tokens (greedy,
        lookup), verified by sample-and-match."""
        ...

    def drop(self, req_id: str) -> None:
        """Forget any state kept for ``req_id``."""
        ...
