"""Separated policy: prefill XOR decode per step, bucket padding, KV admission control
(the scheduler design of AWS Neuron's vLLM backend: fixed buckets, one prefill at a time).

Each step is one of::

    ACTIVE_PREFILL  one request, one chunk of <= max_num_batched_tokens tokens,
                    padded to the smallest num_batched_tokens_buckets entry >= chunk;
                    every decode is held back this step
    ACTIVE_DECODE   every running decode (1 token each, at most max_num_batched_tokens
                    of them; draft tokens, speculative decoding, from the budget
                    left), the batch padded to the smallest num_seqs_buckets
                    entry >= its number of requests
    IDLE            nothing unfinished

Holdback queue: waiting requests are admitted one at a time, FIFO, only when
(1) ``len(running) < max_num_seqs``, (2) no prefill is in progress, (3) no other
prefill was admitted this step (``max_prefills_per_batch = 1``) and
(4) ``len(running) <`` the KV cache's concurrency at ``max_model_len``. Rule (4)
prevents the deadlock where a prefill waits for blocks that only the hidden decodes
could free: a request that would not fit stays in the holdback queue and decodes run.

A long prompt stays in prefill across chunks; when a prefill finishes, or a decode
finishes and frees a slot while a prefill waits, the next step is a prefill (prefill
priority). ``num_scheduled_tokens`` is the actual count (what ``num_computed_tokens``
advances by); ``num_scheduled_tokens_padded`` the padded one.

Step-time budget: with ``max_step_ms`` and a cost model attached, a prefill step
taken while decodes are running (they wait for it) gets the largest
``num_batched_tokens_buckets`` entry whose padded chunk the model predicts to run in
``max_step_ms`` at the prompt's context, at least the smallest bucket (the minimum
progress rule); with no decodes running it uses all of ``max_num_batched_tokens``.

Unlike the seed hardware we do not require a chunk to equal ``kv_segment_size``,
and as a safety net (never needed while rule (4) holds) a decode that cannot get a
block preempts the youngest running request by recompute instead of hanging.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvserve.buckets import get_bucket
from kvserve.config import SchedulerConfig
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_transfer.connector import KVConnectorScheduler
from kvserve.request import Request, RequestStatus
from kvserve.sched.base import Scheduler, SchedulerState
from kvserve.sched.output import SchedulerOutput
from kvserve.sched.spec import fit_drafts
from kvserve.sched.step_builder import StepBuilder, chunk_size, is_decode

MAX_PREFILLS_PER_BATCH = 1


class SeparatedScheduler(Scheduler):
    """Prefill and decode never share a step; see the module docstring."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        *,
        kv_connector: KVConnectorScheduler | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(config, kv_cache_manager, kv_connector=kv_connector, clock=clock)
        # resolved() in the base filled both lists in.
        self.num_batched_tokens_buckets = tuple(self.config.num_batched_tokens_buckets or ())
        self.num_seqs_buckets = tuple(self.config.num_seqs_buckets or ())
        self.max_prefills_per_batch = MAX_PREFILLS_PER_BATCH
        # Requests that fit at once if each grows to max_model_len (rule 4); at least 1
        # because add_request refuses a request that cannot fit alone.
        self.max_kv_concurrent = max(
            1, kv_cache_manager.max_concurrent_requests(self.max_model_len)
        )

    @classmethod
    def decode_batch_buckets(cls, config: SchedulerConfig) -> tuple[int, ...] | None:
        """``num_seqs_buckets``: a decode batch is padded to the smallest that holds it."""
        return None if config.num_seqs_buckets is None else tuple(config.num_seqs_buckets)

    @property
    def max_running_requests(self) -> int:
        """Rule (4): at most the KV cache's concurrency at ``max_model_len``."""
        return min(self.max_num_seqs, self.max_kv_concurrent)

    @property
    def at_capacity(self) -> bool:
        return len(self.running) >= self.max_num_seqs

    def _prefill_in_running(self) -> Request | None:
        return next((r for r in self.running if not is_decode(r)), None)

    def can_schedule(self) -> bool:
        """Admission rules (1), (2) and (4) for the head of the holdback queue, whose
        samples (n > 1) all count; rule (3) holds because a step admits at most one.
        A group larger than the KV concurrency runs alone."""
        if self.at_capacity or self._prefill_in_running() is not None:
            return False
        group = 1 + len(self.waiting[0].pending_forks) if self.waiting else 1
        if self.waiting and not self._group_fits(self.waiting[0]):
            return False
        return not self.running or len(self.running) + group <= self.max_kv_concurrent

    def schedule(self) -> SchedulerOutput:
        step = self._new_step()
        budget = self.max_num_batched_tokens

        prefill = self._prefill_in_running()
        if prefill is None:
            if self.waiting and self.can_schedule():
                # Admit the head of the holdback queue; on no fit it stays there.
                self._admit(self.waiting[0], self._prefill_budget, 0, step)
        else:
            chunk = self._prefill_budget(prefill.num_computed_tokens)
            num_tokens = chunk_size(prefill.num_tokens - prefill.num_computed_tokens, chunk)
            new_blocks = self.kv_cache_manager.allocate_slots(prefill, num_tokens)
            if new_blocks is not None:
                step.add_running(prefill, num_tokens, new_blocks)
            # else: the prefill keeps its blocks and waits; decodes run this step.

        if not step.num_scheduled_tokens:
            decodes = [r for r in self.running if is_decode(r)][:budget]
            extra = budget - len(decodes)  # budget left for draft tokens
            for request in decodes:
                if request.status != RequestStatus.RUNNING:
                    continue  # preempted as a victim earlier in this loop
                n = 1
                if extra > 0 and request.spec_token_ids:
                    wanted = request.num_tokens_with_spec - request.num_computed_tokens
                    n = fit_drafts(self.kv_cache_manager, request, min(wanted, 1 + extra))
                new_blocks = self._allocate_or_preempt(request, n, step)
                if new_blocks is not None:
                    step.add_running(request, n, new_blocks)
                    extra -= n - 1

        return self._pad(step)

    def _prefill_budget(self, context: int) -> int:
        """Tokens of a prefill chunk at ``context``: ``max_num_batched_tokens``, or under a
        step-time budget while decodes wait, the largest bucket predicted to fit
        ``max_step_ms`` (at least the smallest; see the module docstring)."""
        budget = self.max_num_batched_tokens
        timed = self.step_time_budget()
        if timed is None or not any(is_decode(r) for r in self.running):
            return budget
        buckets = [b for b in self.num_batched_tokens_buckets if b <= budget] or [budget]
        best = buckets[0]
        for b in buckets[1:]:
            if timed.prompt_tokens(context, b) >= b:
                best = b
        return best

    def _active_state(self, step: StepBuilder) -> SchedulerState:
        if step.prefill_ids:
            return SchedulerState.ACTIVE_PREFILL
        if step.decode_ids:
            return SchedulerState.ACTIVE_DECODE
        return self.state  # nothing ran (a prefill waits for blocks): unchanged

    def _pad(self, step: StepBuilder) -> SchedulerOutput:
        """Pad prefill chunks and the decode batch to their buckets; refuse mixing."""
        if step.prefill_ids and step.decode_ids:
            raise RuntimeError(
                f"separated policy violated: prefill {step.prefill_ids} and decode "
                f"{step.decode_ids} in the same step"
            )
        if len(step.prefill_ids) > self.max_prefills_per_batch:
            raise RuntimeError(
                f"separated policy violated: {len(step.prefill_ids)} prefills in one step"
            )
        padded: dict[str, int] = {}
        for req_id in step.prefill_ids:
            n = step.num_scheduled_tokens[req_id]
            padded[req_id] = get_bucket(n, self.num_batched_tokens_buckets)
            self.num_prefill_padding_tokens += padded[req_id] - n
        decode_batch_size_padded: int | None = None
        if step.decode_ids:
            for req_id in step.decode_ids:
                padded[req_id] = step.num_scheduled_tokens[req_id]  # 1 + its drafts
            decode_batch_size_padded = get_bucket(len(step.decode_ids), self.num_seqs_buckets)
            self.num_decode_padding_tokens += decode_batch_size_padded - len(step.decode_ids)
        return self._build_output(step, padded, decode_batch_size_padded)
