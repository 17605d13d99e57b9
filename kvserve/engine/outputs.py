"""What the engine hands to users: per-step deltas for streaming and whole outputs.

``RequestDelta`` is what one engine step produced for one request (new token ids
and the new text they decode to); ``RequestOutput`` is the vLLM-shaped
accumulated result that ``LLM.generate`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.sched.output import Logprobs


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (seconds since the epoch); None until they happen."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # the step that produced the newest token
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics


@dataclass
class RequestDelta:
    """One step's news for one request (for streaming)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
