"""Applying one executed step to a scheduler (:func:`update_from_output`): computed
tokens, newly full blocks cached, sampled tokens appended (speculative drafts
rolled back), stop checks, sample forks, and the finished requests freed.

The rules are :meth:`kvserve.sched.base.Scheduler.update_from_output`'s: each
non-empty schedule output once, in order."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sched import spec
from kvserve.sched.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvserve.sched.samples import SampleForker
from kvserve.sched.spec_stats import SpecDecodingStats


class SchedulerView(Protocol):
    """What applying a step reads and changes of a scheduler (``sched.base.Scheduler``
    has it all; this module does not import it, so the two are not a cycle)."""

    kv_cache_manager: KVCacheManager
    clock: Callable[[], float]
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    forker: SampleForker
    spec_stats: SpecDecodingStats
    enable_prefix_caching: bool
    max_model_len: int

    def stop_after_token(self, request: Request) -> bool: ...

    def free_finished(self, request: Request) -> None: ...

    def refresh_state(self) -> None: ...


def update_from_output(
    sched: SchedulerView,
    scheduler_output: SchedulerOutput,
    model_runner_output: ModelRunnerOutput,
) -> list[EngineCoreOutput]:
    """:meth:`Scheduler.update_from_output <kvserve.sched.base.Scheduler.update_from_output>`
    on ``sched`` (its rules and errors)."""
    kv = sched.kv_cache_manager
    now = sched.clock()
    outputs: list[EngineCoreOutput] = []
    for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        request = sched.requests.get(req_id)
        if request is None or request.status != RequestStatus.RUNNING:
            continue
        expected = scheduler_output.cached_seq_len[req_id]
        if request.num_computed_tokens != expected:
            raise RuntimeError(
                f"update_from_output: request {req_id!r} has num_computed_tokens="
                f"{request.num_computed_tokens} but this output was scheduled at {expected}; "
                "apply each schedule() output exactly once, in order"
            )
        request.num_computed_tokens += num_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
        if sched.enable_prefix_caching and not drafts:
            kv.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens < request.num_tokens:
            continue  # mid-prefill: nothing sampled
        sampled = model_runner_output.sampled_token_ids.get(req_id)
        if not sampled:
            raise RuntimeError(
                f"update_from_output: the model runner returned no sampled token for "
                f"{req_id!r}, which computed all its {request.num_tokens} tokens this step"
            )
        if drafts:  # roll back the rejected drafts (kvserve.sched.spec)
            spec.rollback(request, len(drafts), sampled, sched.spec_stats)
        new_token_ids: list[int] = []
        for token_id in sampled:
            request.append_output_token_ids(token_id)
            new_token_ids.append(token_id)
            if sched.stop_after_token(request):
                break
        if drafts:
            spec.apply_verification(request, kv, sched.enable_prefix_caching)
        spec.take_proposals(
            request, model_runner_output.spec_token_ids.get(req_id), sched.max_model_len
        )
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        logprobs = model_runner_output.logprobs.get(req_id)
        forked = None
        if request.pending_forks:
            forked = sched.forker.fork(request, model_runner_output, now, sched.stop_after_token)
            sched.running.extend(forked.running)
            sched.waiting.extendleft(reversed(forked.requeue))
            for sample in forked.finished:
                sched.free_finished(sample)
        finish_reason = request.finish_reason
        if request.is_finished:
            sched.running.remove(request)
            sched.free_finished(request)
        outputs.append(EngineCoreOutput.of(request, new_token_ids, logprobs, finish_reason))
        if forked is not None:
            outputs.extend(forked.outputs)
    sched.refresh_state()
    return outputs
