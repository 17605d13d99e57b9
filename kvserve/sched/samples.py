"""Forking the samples of one request (``n``/``best_of``) once its prompt has KV.

    leader:   [ prompt ......... computed ] -> first token t0 (sampled by the runner)
    sample i: shares the prompt's full blocks, a copy of the partial last block,
              first token ti drawn by the runner from the leader's last logits row

:class:`SampleForker` is the scheduler's part of it: it names the forks a step must
sample (``forks_of``), turns the runner's first tokens into running samples
(``fork``), and keeps what the runner is still owed: the block copies to make before
the next forward (``take_block_copies``) and the forked samples it has not seen
(``new_to_runner``, sent as new requests with all their blocks).

Rules for callers (the scheduler): call :meth:`SampleForker.fork` from
``update_from_output`` in the step that computed the leader's prompt, then put its
``running`` samples in the running queue, its ``requeue`` samples at the front of the
waiting queue (in order) and release its ``finished`` ones; drop a request from
``new_to_runner`` when it is preempted or finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import FinishReason, Request, RequestStatus
from kvserve.sched.output import EngineCoreOutput, ForkData, Logprobs, ModelRunnerOutput


@dataclass
class ForkResult:
    """What :meth:`SampleForker.fork` did with each sample (see the module docstring)."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    requeue: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


class SampleForker:
    """Forks samples over the KV cache manager (see the module docstring)."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv = kv_cache_manager
        self.new_to_runner: set[str] = set()
        self._block_copies: list[tuple[int, int]] = []

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copies owed to the runner since the last call (they go in the next output)."""
        copies, self._block_copies = self._block_copies, []
        return copies

    @staticmethod
    def forks_of(
        num_scheduled_tokens: Mapping[str, int], requests: Mapping[str, Request]
    ) -> dict[str, list[ForkData]]:
        """The pending samples of every leader whose prompt this step completes."""
        forks: dict[str, list[ForkData]] = {}
        for req_id, n in num_scheduled_tokens.items():
            request = requests[req_id]
            if request.pending_forks and request.num_computed_tokens + n >= request.num_tokens:
                forks[req_id] = [
                    ForkData(s.req_id, s.sampling_params) for s in request.pending_forks
                ]
        return forks

    def fork(
        self,
        leader: Request,
        runner_output: ModelRunnerOutput,
        now: float,
        check_stop: Callable[[Request], bool],
    ) -> ForkResult:
        """Fork the leader's pending samples now that its prompt has KV.

        A sample with a first token from the runner appends it (``check_stop`` may
        finish it) and, unless finished, shares the prompt's blocks and runs as a
        decode; when no block is free for its copy it is requeued to compute the
        prompt itself (prefix-cache hits), keeping its token. A sample without a
        token (a runner that does not fork) is requeued as it was."""
        samples, leader.pending_forks = leader.pending_forks, []
        result = ForkResult()
        for sample in samples:
            sample.fork_parent = None
            sampled = runner_output.sampled_token_ids.get(sample.req_id)
            if not sampled:
                result.requeue.append(sample)
                continue
            sample.append_output_token_ids(sampled[0])
            sample.first_scheduled_time = leader.first_scheduled_time
            sample.first_token_time = sample.last_token_time = now
            sample.num_cached_tokens = max(leader.num_cached_tokens, 0)
            sample.status = RequestStatus.RUNNING
            if check_stop(sample):
                result.finished.append(sample)
            else:
                copies = self.kv.fork(leader, sample, leader.num_prompt_tokens)
                if copies is None:
                    sample.status = RequestStatus.WAITING
                    sample.num_cached_tokens = -1
                    result.requeue.append(sample)
                else:
                    sample.num_computed_tokens = leader.num_prompt_tokens
                    self._block_copies.extend(copies)
                    self.new_to_runner.add(sample.req_id)
                    result.running.append(sample)
            logprobs = runner_output.logprobs.get(sample.req_id)
            result.outputs.append(core_output(sample, [sampled[0]], logprobs, sample.finish_reason))
        return result


def core_output(
    request: Request,
    new_token_ids: list[int],
    logprobs: list[Logprobs] | None,
    finish_reason: FinishReason | None,
) -> EngineCoreOutput:
    """The :class:`EngineCoreOutput` of one request's step."""
    return EngineCoreOutput(
        req_id=request.req_id,
        new_token_ids=new_token_ids,
        new_logprobs=logprobs[: len(new_token_ids)] if logprobs else None,
        finish_reason=finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(0, request.num_cached_tokens),
    )
