"""Forking the samples of one request (``n``/``best_of``) once its prompt has KV.

    leader:   [ prompt ......... computed ] -> first token t0 (sampled by the runner)
    sample i: shares the prompt's full blocks, a copy of the partial last block,
              first token ti drawn by the runner from the leader's last logits row

:class:`SampleForker` is the scheduler's part of it: it names the forks a step must
sample (``forks_of``), turns the runner's first tokens into running samples
(``fork``), and keeps what the runner is still owed: the block copies to make before
the next forward (``take_block_copies``) and the forked samples it has not seen
(``new_to_runner``, sent as new requests with all their blocks).

Only the leader is queued; the other samples are in the scheduler's ``requests``
but in neither queue until the step that computes the leader's prompt. A sample that
got no token (a runner without fork support) or no block for its copy is queued at
the front of ``waiting`` and computes the prompt itself (a prefix-cache hit for all
its full blocks). A group is admitted only when all its samples fit under
``max_num_seqs``; a leader finishing before its prompt is computed hands the group
to its first sample (:func:`hand_over_lead`).

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
from kvserve.request import Request, RequestStatus
from kvserve.sched.output import EngineCoreOutput, ForkData, ModelRunnerOutput


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
            result.outputs.append(
                EngineCoreOutput.of(sample, [sampled[0]], logprobs, sample.finish_reason)
            )
        return result


def hand_over_lead(leader: Request) -> Request | None:
    """A leader that finishes (abort, stop string) before its prompt is computed hands
    its pending samples over: the first becomes the leader of the rest. Returns that
    heir, which the caller queues where the leader waited, or None when the leader had
    no pending samples (nothing changes)."""
    if not leader.pending_forks:
        return None
    heir, rest = leader.pending_forks[0], leader.pending_forks[1:]
    heir.pending_forks, leader.pending_forks = rest, []
    heir.fork_parent = None
    for sample in rest:
        sample.fork_parent = heir
    return heir
