"""What both scheduling policies share: queues, admission, preemption, stop checks,
``update_from_output``, ``finish_requests`` and the counters metrics read.

A policy subclass only decides, in :meth:`Scheduler.schedule`, who runs this step and
how many tokens each computes. The rule every request follows (vLLM V1)::

    all_token_ids:  [ prompt ............ | outputs ... ]
                      [ computed (has KV)  )[ to compute )
                                           ^ num_computed_tokens   ^ num_tokens

A step schedules ``n`` tokens ``all_token_ids[num_computed : num_computed + n]``.
``update_from_output`` advances ``num_computed_tokens`` by ``n``; when it reaches
``num_tokens`` the model's sampled token is appended (so mid-prefill chunks sample
nothing). A request is *in decode* when its prompt is done and exactly its last
sampled token is left to compute (``num_computed_tokens == num_tokens - 1``);
otherwise it is *in prefill* (a fresh prompt, the rest of a chunked prompt, or a
preempted request recomputing prompt + outputs).

Rules a caller (the engine) must keep:

- Call :meth:`Scheduler.update_from_output` with each non-empty output of
  :meth:`Scheduler.schedule`, once, before calling ``schedule`` again. A second or
  stale update raises RuntimeError instead of corrupting the counts.
- The model runner returns at least one sampled token for every request whose
  ``num_computed_tokens`` reaches ``num_tokens`` in that step.
- Finished requests leave :attr:`Scheduler.requests` inside the call that finishes
  them (``update_from_output`` or ``finish_requests``); keep your own reference.

Samples of one request (``n``/``best_of``) fork once the leader's prompt is computed:
see :mod:`kvserve.sched.samples`.
"""

from __future__ import annotations

import abc
import enum
import time
from collections import deque
from collections.abc import Callable, Iterable

from kvserve.config import SchedulerConfig
from kvserve.kv_cache.blocks import KVCacheBlocks
from kvserve.kv_cache.hashing import BlockHash
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_transfer.connector import KVConnectorScheduler
from kvserve.request import Request, RequestStatus
from kvserve.sched import kv_admission, update
from kvserve.sched.cost_model import CostModel, StepBudget
from kvserve.sched.kv_admission import Admission, Admitter, Budget, Outcome
from kvserve.sched.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvserve.sched.remote_kv import RemoteKV
from kvserve.sched.samples import SampleForker, hand_over_lead
from kvserve.sched.schedulable import check_schedulable, running_seqs
from kvserve.sched.spec_stats import SpecDecodingStats
from kvserve.sched.step_builder import StepBuilder
from kvserve.sched.stop import check_stop


class SchedulerState(enum.StrEnum):
    """What the last step did, exposed for metrics.

    The separated policy moves between IDLE, ACTIVE_PREFILL and ACTIVE_DECODE (seed
    "Scheduler Design"); the mixed policy has no phases and reports IDLE or ACTIVE.
    """

    IDLE = "IDLE"
    ACTIVE = "ACTIVE"
    ACTIVE_PREFILL = "ACTIVE_PREFILL"
    ACTIVE_DECODE = "ACTIVE_DECODE"


class Scheduler(abc.ABC):
    """Base of both policies. Subclasses implement :meth:`schedule`.

        ``config`` is resolved (validated, default buckets filled in) on construction;
        a bad config, or a ``max_model_len`` longer than the KV cache manager was built
        for, raises ValueError. The block size and prefix caching are the manager's. ``clock`` returns the time stamped on requests
        (``first_scheduled_time``, ``first_token_time``, ``finished_time``); the
        simulator passes the step number. ``kv_connector``: see
    :class:`~kvserve.kv_transfer.connector.KVConnectorScheduler`. With one, a request
    whose prompt KV comes from outside waits in ``waiting_for_remote`` (blocks held,
    not scheduled) until its load ends, then goes back to the front of ``waiting``;
    a finished request whose blocks the connector still sends waits in
    ``sending`` until the connector lets them go.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        *,
        kv_connector: KVConnectorScheduler | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        config = config.resolved()
        if kv_cache_manager.max_model_len < config.model_len:
            raise ValueError(
                f"invalid max_model_len={config.max_model_len}: the KV cache manager was built for "
                f"at most {kv_cache_manager.max_model_len} tokens per request "
                f"(for example: max_model_len={kv_cache_manager.max_model_len})"
            )
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.kv_connector = kv_connector
        self.clock = clock
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.model_len
        self.enable_prefix_caching = kv_cache_manager.enable_caching
        # Unfinished requests only; a request leaves when it finishes.
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_kv = RemoteKV(kv_connector, kv_cache_manager)
        self.waiting_for_remote = self.remote_kv.waiting  # parked for a remote load
        self.sending = self.remote_kv.sending  # finished; blocks freed when sent
        self.admitter = Admitter(
            kv_cache_manager,
            self.remote_kv,
            clock,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        # Requests the connector failed under policy "fail": (request, error), drained
        # by the engine, which ends their streams with the error.
        self.failed_requests: list[tuple[Request, str]] = []
        # Finished, aborted or preempted since the last output: the runner drops them.
        self._finished_req_ids: set[str] = set()
        self.forker = SampleForker(kv_cache_manager)
        self._state = SchedulerState.IDLE
        self.num_preemptions = 0
        self.num_prefill_padding_tokens = 0
        self.num_decode_padding_tokens = 0
        self.num_steps = 0
        # Step-time model (kvserve.sched.cost_model), set by the engine; None: token
        # budgets only. ``config.max_step_ms`` applies only with one.
        self.cost_model: CostModel | None = None
        self.spec_stats = SpecDecodingStats()  # speculative decoding (kvserve.spec_decode)

    # ------------------------------------------------------------------ counters
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def total_padding_tokens(self) -> int:
        """Padded minus actual tokens over all steps: prefill chunk padding plus one
        token per dummy decode row (0 under the mixed policy)."""
        return self.num_prefill_padding_tokens + self.num_decode_padding_tokens

    @property
    def state(self) -> SchedulerState:
        return self._state

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_remote)

    @classmethod
    def decode_batch_buckets(cls, config: SchedulerConfig) -> tuple[int, ...] | None:
        """The batch sizes this policy pads decode steps to (the runner compiles one
        decode graph per size); None: it never pads a decode batch."""
        return None

    @property
    def max_running_requests(self) -> int:
        """The most requests this policy ever runs at once (``max_num_seqs`` unless
        the policy admits fewer, as the separated policy's KV admission rule does)."""
        return self.max_num_seqs

    def take_failed_requests(self) -> list[tuple[Request, str]]:
        """The requests the connector failed since the last call, with their errors
        (already finished and released here: end their streams with the error)."""
        failed, self.failed_requests = self.failed_requests, []
        return failed

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a fresh request (FCFS). Raises ValueError and changes nothing when
        :meth:`check_request` refuses it."""
        self.check_request(request)
        self.requests[request.req_id] = request
        for sample in request.pending_forks:
            self.requests[sample.req_id] = sample
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """:func:`~kvserve.sched.schedulable.check_schedulable` against this scheduler's
        queues, ``max_num_seqs``, ``max_model_len`` and KV cache. Changes nothing."""
        check_schedulable(
            request,
            self.requests,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            kv=self.kv_cache_manager,
        )

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests now (abort, stop string): their blocks are freed at once and
        their ids go to the next output's ``finished_req_ids``. Unknown or already
        finished ids are ignored. ``status`` must be a finished status."""
        if not status.is_finished:
            raise ValueError(
                f"finish_requests got status={status}: use a finished status such as "
                f"{RequestStatus.FINISHED_ABORTED}"
            )
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            parent = request.fork_parent
            idx = 0  # where an heir waits: the leader's place, or the front
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif req_id in self.waiting_for_remote:
                del self.waiting_for_remote[req_id]
            elif parent is not None and request in parent.pending_forks:
                parent.pending_forks.remove(request)  # never queued
            else:
                idx = self.waiting.index(request)
                del self.waiting[idx]
            heir = hand_over_lead(request)  # its prompt is not computed yet
            if heir is not None:
                self.waiting.insert(idx, heir)
            request.status = status
            self.free_finished(request)
        self.refresh_state()

    def _group_fits(self, request: Request) -> bool:
        """Whether admitting ``request`` and its pending samples keeps ``max_num_seqs``,
        counting the samples running leaders will fork (they join ``running`` when the
        leader's prompt is computed)."""
        return running_seqs(self.running) + 1 + len(request.pending_forks) <= self.max_num_seqs

    def _new_step(self) -> StepBuilder:
        """A StepBuilder that sends forked samples to the runner as new requests."""
        return StepBuilder(self.forker.new_to_runner, self.kv_cache_manager.get_block_ids)

    def free_finished(self, request: Request) -> None:
        """Release a finished request (already out of both queues): its blocks, its
        place in ``requests``; its id goes to the next output's ``finished_req_ids``."""
        self._release_blocks(request)
        self.forker.new_to_runner.discard(request.req_id)
        request.finished_time = self.clock()
        self._finished_req_ids.add(request.req_id)
        del self.requests[request.req_id]

    def _release_blocks(self, request: Request) -> None:
        if not self.remote_kv.keeps_blocks(request):  # else freed by poll_kv_connector
            self.kv_cache_manager.free(request)

    # ------------------------------------------------------------------ KV connector
    def poll_kv_connector(self) -> None:
        """Apply what the connector finished since the last call
        (:meth:`~kvserve.sched.remote_kv.RemoteKV.poll`): resumed requests go back to
        the front of ``waiting``; a fatal load failure ends its request with the
        error (``failed_requests``). No-op without a connector."""
        polled = self.remote_kv.poll(self.enable_prefix_caching)
        for request in polled.resumed:
            self.waiting.appendleft(request)
        for request, error in polled.failed:
            request.status = RequestStatus.FINISHED_ABORTED
            self.free_finished(request)
            self.failed_requests.append((request, error))
        self.refresh_state()

    # ------------------------------------------------------------------ scheduling helpers
    def step_time_budget(self) -> StepBudget | None:
        """A fresh ``max_step_ms`` budget for this step, or None when the time budget is
        off (``max_step_ms`` 0, or no cost model attached)."""
        if self.cost_model is None or not self.config.max_step_ms:
            return None
        return self.cost_model.budget(self.config.max_step_ms, self.config.short_prompt_step_ms)

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide this step's requests and token counts; allocate their KV blocks."""

    def _in_flight_blocks(self) -> set[BlockHash]:
        """Hashes of the full prompt blocks that running requests have not computed
        yet (:func:`~kvserve.sched.kv_admission.in_flight_blocks`); see :meth:`_admit`."""
        return kv_admission.in_flight_blocks(self.running, self.kv_cache_manager.block_size)

    def _add_in_flight(self, request: Request, in_flight: set[BlockHash]) -> None:
        """Add ``request``'s not yet computed full prompt blocks to ``in_flight``."""
        kv_admission.add_in_flight(request, in_flight, self.kv_cache_manager.block_size)

    def _admit(
        self,
        request: Request,
        budget: Budget,
        cap: int,
        step: StepBuilder,
        in_flight: set[BlockHash] | None = None,
    ) -> Admission:
        """Try to move ``request`` (in ``waiting``, usually its head) to ``running``
        with its first chunk (:meth:`~kvserve.sched.kv_admission.Admitter.admit`): ``RUN``
        with the tokens scheduled (added to ``step``), ``PARK`` when the connector
        loads part of the prompt (now in ``waiting_for_remote``), ``NO_FIT`` when the
        budget or the blocks do not fit and, only with ``in_flight`` (from
        :meth:`_in_flight_blocks`), ``DEFER`` when the blocks it would compute first
        are being computed by a running request. ``NO_FIT`` and ``DEFER`` change
        nothing."""
        admission = self.admitter.admit(request, budget, cap, in_flight)
        if admission.changed:
            self._remove_waiting(request)
        if admission.outcome is Outcome.RUN:
            self.running.append(request)
            block_ids = self.kv_cache_manager.get_block_ids(request.req_id)
            step.add_new(request, admission.num_tokens, block_ids)
        return admission

    def _remove_waiting(self, request: Request) -> None:
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free the blocks, reset progress, requeue at the front."""
        self.running.remove(request)
        self._release_blocks(request)
        self.forker.new_to_runner.discard(request.req_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._finished_req_ids.add(request.req_id)

    def _allocate_or_preempt(
        self, request: Request, num_tokens: int, step: StepBuilder
    ) -> KVCacheBlocks | None:
        """``allocate_slots`` for a running request, preempting the youngest running
        request not yet scheduled this step until it fits. Returns the new blocks, or
        None when ``request`` itself had to be preempted."""
        kv = self.kv_cache_manager
        while True:
            new_blocks = kv.allocate_slots(request, num_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = next(
                (
                    r
                    for r in reversed(self.running)
                    if r is not request and r.req_id not in step.num_scheduled_tokens
                ),
                request,
            )
            self._preempt(victim)
            if victim is request:
                return None

    @abc.abstractmethod
    def _active_state(self, step: StepBuilder) -> SchedulerState:
        """The state a step reports while requests are unfinished (the policy's part
        of :meth:`_set_state`)."""

    def refresh_state(self) -> None:
        """IDLE once nothing is unfinished; else the last step's state stands."""
        self._set_state(self._state)

    def _set_state(self, active: SchedulerState) -> None:
        """The one place the state changes: IDLE when nothing is unfinished, else
        ``active``."""
        self._state = active if self.has_unfinished_requests() else SchedulerState.IDLE

    def _build_output(
        self,
        step: StepBuilder,
        num_scheduled_tokens_padded: dict[str, int] | None = None,
        decode_batch_size_padded: int | None = None,
    ) -> SchedulerOutput:
        """The step's SchedulerOutput; also sets the state and hands over the ids
        finished since the last output."""
        self._set_state(self._active_state(step))
        finished, self._finished_req_ids = self._finished_req_ids, set()
        copies = self.forker.take_block_copies()
        forks = self.forker.forks_of(step.num_scheduled_tokens, self.requests)
        self.num_steps += 1
        out = SchedulerOutput(
            phase=step.phase,
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            num_scheduled_tokens_padded=(
                dict(step.num_scheduled_tokens)
                if num_scheduled_tokens_padded is None
                else num_scheduled_tokens_padded
            ),
            scheduled_token_ids=step.scheduled_token_ids,
            cached_seq_len=step.cached_seq_len,
            finished_req_ids=finished,
            decode_batch_size_padded=decode_batch_size_padded,
            forks=forks,
            block_copies=copies,
            scheduled_spec_decode_tokens=step.spec_tokens,
        )
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        return out

    # ------------------------------------------------------------------ results
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one executed step; return one output per request that got tokens.

        For each scheduled request still unfinished: advance ``num_computed_tokens``
        by the actual count, cache its newly full blocks, and, when all its tokens
        now have KV, append the sampled tokens, run the stop checks and free it if it
        finished. Requests finished meanwhile (aborted) are skipped. Raises
        RuntimeError on a stale or repeated output, or when the runner returned no
        token for a request that needed one.
        """
        return update.update_from_output(self, scheduler_output, model_runner_output)

    def stop_after_token(self, request: Request) -> bool:
        """:func:`~kvserve.sched.stop.check_stop` at this scheduler's ``max_model_len``."""
        return check_stop(request, self.max_model_len)
