"""The plain-data contract between the scheduler and the model runner.

Nothing here holds tensors. The scheduler produces a :class:`SchedulerOutput` each
step; the model runner consumes it and returns a :class:`ModelRunnerOutput`, which the
scheduler consumes in ``update_from_output``.

Diffs, as in vLLM V1: a request's first scheduled step (or its first step after a
preemption) appears in ``scheduled_new_reqs`` with its tokens and all its block ids;
later steps appear in ``scheduled_cached_reqs`` with only the blocks added since.
``finished_req_ids`` lists requests that finished or were aborted/preempted since the
previous step so the runner drops their state.

Samples of one request (``n`` > 1): in the step where the leader's prompt is done,
``forks[leader]`` names the other samples; the runner samples each one's first token
from the leader's last logits row (same logits, the sample's own params and seed).
The scheduler then gives each sample the prompt's blocks; ``block_copies`` are the
partial-block copies (copy on write) the runner makes before the next forward.

For every scheduled request ``r``:
    token range computed this step = [cached_seq_len[r], cached_seq_len[r] + num_scheduled_tokens[r])
    cached_seq_len[r] == num_computed_tokens before the step
    num_scheduled_tokens_padded[r] >= num_scheduled_tokens[r]  (separated policy pads prefill chunks)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvserve.kv_transfer.connector import KVConnectorMetadata
from kvserve.request import FinishReason, Request, SamplingParams

Phase = Literal["prefill", "decode", "mixed", "idle"]


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption).

    ``prompt_token_ids`` is the original prompt; ``output_token_ids`` holds tokens
    already generated before a preemption (empty on first admission). The runner's
    token history is ``prompt_token_ids + output_token_ids``.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    adapter_id: str | None = None  # the LoRA adapter's id (kvserve.lora), None: base


@dataclass
class ForkData:
    """A sample that takes its first token from its leader's prompt logits."""

    req_id: str
    sampling_params: SamplingParams


@dataclass
class CachedRequestData:
    """Requests the runner already knows, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What to compute in one step.

    ``scheduled_token_ids[r]`` are the token ids of ``r`` computed this step
    (length ``num_scheduled_tokens[r]``), so the runner never guesses inputs.
    ``decode_batch_size_padded`` is set for separated-policy decode steps: the
    runner pads the batch with dummy rows up to it (they write no KV). ``forks`` and
    ``block_copies``: see the module docstring; copies run before the forward, also
    in a step that schedules nothing.
    """

    phase: Phase
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    num_scheduled_tokens_padded: dict[str, int]
    scheduled_token_ids: dict[str, list[int]]
    cached_seq_len: dict[str, int]
    finished_req_ids: set[str] = field(default_factory=set)
    decode_batch_size_padded: int | None = None
    # KVConnectorMetadata for the worker side of a KV connector (None: nothing to do).
    kv_connector_metadata: KVConnectorMetadata | None = None
    forks: dict[str, list[ForkData]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the draft tokens among a request's scheduled tokens (its
    # last ones); the runner verifies them (kvserve.sched.spec).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def scheduled_req_ids(self) -> list[str]:
        """Scheduled requests in batch order: new requests first, then cached ones."""
        return [r.req_id for r in self.scheduled_new_reqs] + list(
            self.scheduled_cached_reqs.req_ids
        )

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @classmethod
    def idle(cls, finished_req_ids: set[str] | None = None) -> SchedulerOutput:
        """A step that schedules nothing; ``finished_req_ids``: requests the workers drop."""
        return cls(
            phase="idle",
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={},
            num_scheduled_tokens_padded={},
            scheduled_token_ids={},
            cached_seq_len={},
            finished_req_ids=set() if finished_req_ids is None else finished_req_ids,
        )


@dataclass
class Logprobs:
    """Logprob of the sampled (or, for a prompt position, the actual next) token, its
    rank (1 = most likely; set for prompt logprobs) and the top-N alternatives."""

    sampled_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None


@dataclass
class ModelRunnerOutput:
    """Per scheduled request: the sampled token ids (empty while mid-prefill; with
    verified drafts the accepted drafts then one more token), and for forks the
    samples' first tokens under their own ids.

    ``prompt_logprobs[r] = (start, entries)``: for a request with
    ``prompt_logprobs`` set, ``entries[j]`` scores prompt token ``start + j + 1`` given
    the tokens before it (the chunk's positions whose next token is in the prompt).
    """

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)
    # Requests the runner cannot go on with (their grammar matcher failed): req id ->
    # why. The engine ends them with an error; their sampled token is dropped.
    failed: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: draft tokens proposed for each request's next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What ``update_from_output`` reports per request that advanced this step.

    ``new_token_ids`` are the tokens appended this step (empty for a request that
    only finished, e.g. aborted). ``finish_reason`` is set on the step it finishes.
    """

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @classmethod
    def of(
        cls,
        request: Request,
        new_token_ids: list[int],
        logprobs: list[Logprobs] | None,
        finish_reason: FinishReason | None,
    ) -> EngineCoreOutput:
        """The output of one request's step: ``new_token_ids`` appended, their
        ``logprobs`` (cut to as many), and ``finish_reason`` when it finished."""
        return cls(
            req_id=request.req_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs[: len(new_token_ids)] if logprobs else None,
            finish_reason=finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(0, request.num_cached_tokens),
        )
