"""From the scheduler's per-request outputs to the engine's :class:`RequestDelta`:
incremental detokenization, stop strings (which finish a request in the scheduler)
and the prompt logprobs each request's first delta carries.

Rules a caller must keep: one :class:`RequestState` per live sample, dropped when
its delta is finished (``process_output`` returns it then)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.outputs import RequestDelta, RequestMetrics
from kvserve.request import FinishReason, Request, RequestStatus
from kvserve.sched.base import Scheduler
from kvserve.sched.output import EngineCoreOutput, Logprobs


@dataclass
class RequestState:
    """One sample's engine-side state. ``prompt_logprobs`` is shared by the samples of
    one request (filled by sample 0, which computes the prompt): index ``p`` scores
    prompt token ``p`` (index 0 stays None)."""

    request: Request
    detokenizer: IncrementalDetokenizer
    prompt_logprobs: list[Logprobs | None] | None = None


def make_delta(
    request: Request,
    finish_reason: FinishReason | None,
    stop_reason: int | str | None = None,
    *,
    new_token_ids: list[int] | None = None,
    new_text: str = "",
    new_logprobs: list[Logprobs] | None = None,
    error: str | None = None,
) -> RequestDelta:
    """The news for one request: its new tokens and text, and its counts and timings
    so far."""
    return RequestDelta(
        request_id=request.req_id,
        new_token_ids=list(new_token_ids or []),
        new_text=new_text,
        new_logprobs=list(new_logprobs or []),
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_output_tokens=request.num_output_tokens,
        metrics=request_metrics(request),
        num_external_tokens=request.num_external_tokens,
        error=error,
        sample_index=request.sample_index,
    )


def request_metrics(request: Request) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        last_token_time=request.last_token_time,
        finished_time=request.finished_time,
    )


def process_output(
    state: RequestState, out: EngineCoreOutput, scheduler: Scheduler
) -> RequestDelta:
    """``out`` (one step's tokens of ``state``'s request) as a delta: the new text,
    finished by EOS, a stop token id or a stop string (which finishes the request in
    ``scheduler``); the request's first delta carries its prompt logprobs."""
    request = state.request
    detok = state.detokenizer
    finish_reason = out.finish_reason
    # The scheduler finishes as "stop" only on EOS or a stop token id, which is
    # then the last new token: the detokenizer leaves its text out.
    stop_terminated = finish_reason == FinishReason.STOP
    text = detok.update(out.new_token_ids, stop_terminated) if out.new_token_ids else ""
    stop_reason = out.stop_reason
    if finish_reason is None and detok.finished_by_stop:
        scheduler.finish_requests(out.req_id, RequestStatus.FINISHED_STOPPED)
        finish_reason, stop_reason = FinishReason.STOP, detok.stop_reason
    if finish_reason is not None:
        if not detok.finished_by_stop:
            text += detok.flush()
        else:
            stop_reason = detok.stop_reason
    delta = make_delta(
        request,
        finish_reason,
        stop_reason,
        new_token_ids=out.new_token_ids,
        new_text=text,
        new_logprobs=out.new_logprobs,
    )
    first = out.new_token_ids and request.num_output_tokens == len(out.new_token_ids)
    if first and state.prompt_logprobs is not None:
        delta.prompt_logprobs = list(state.prompt_logprobs)
    return delta
