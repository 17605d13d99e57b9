"""Mixed policy: one token budget per step, decode first, chunked prefill
(vLLM V1 / Sarathi-Serve style).

Each step has ``max_num_batched_tokens`` tokens of budget::

    budget 512, four decodes running, a 2048-token prompt waiting:
    step 1: [d d d d | 508 prompt tokens]    step 4: [d d d d | 508]
    step 2: [d d d d | 508]                  step 5: [d d d d | 16] -> first token
    step 3: [d d d d | 508]

1. Running requests first. Decodes (1 token each) before partially computed prompts,
   each in running (admission) order. A prompt chunk is
   ``min(remaining tokens, remaining budget)``, further capped by
   ``long_prefill_token_threshold`` when more than one request is unfinished.
   With ``prefill_budget_with_decodes`` set, a step that runs decodes gives prompt
   chunks at most that many tokens (a shorter step, so a shorter wait between two
   tokens of every stream); a step without decodes still uses the whole budget.
   With ``max_step_ms`` set and a cost model attached (``Scheduler.cost_model``, fitted
   by the engine at startup), a step that runs decodes also bounds its prompt chunks
   by time: each chunk gets the tokens the model predicts fit in what is left of
   ``max_step_ms`` after the decodes and earlier chunks, at that prompt's context (a
   chunk over a 2.5k-token context gets far fewer tokens than one over 0). Minimum
   progress: the first prompt chunk of such a step gets at least
   ``MIN_PROMPT_TOKENS_WITH_DECODES`` tokens even when the decodes alone fill the
   target, so prompts never starve behind many decodes. The short-prompt overflow
   below does not apply under a time budget (a short prompt fits by time or waits).
2. Then waiting requests, FCFS, while budget and a sequence slot (``max_num_seqs``)
   remain: prefix-cache lookup (``num_computed_tokens`` starts at the hit length),
   then the first chunk. A request that does not fit stops admission (no skipping).
   No admission happens in a step that preempted. One exception to FCFS: a request
   whose first block to compute is being computed by a running request (in flight)
   is deferred and later requests are admitted past it; a step later that block is a
   prefix-cache hit, so a burst of requests on one new shared prefix computes it once.

Speculative decoding: a decode's draft tokens are scheduled tokens of it (they
count against the budget), but only in a step where no prompt is being computed and
none waits for a free sequence slot, so drafts never slow prompts down.

When decodes take the whole budget, prompts get 0 tokens that step: they are
deferred, never dropped, and continue when budget frees. When blocks run out,
preempt by recompute: the youngest running request not yet scheduled this step (or
the requester itself) frees its blocks and goes back to the front of ``waiting``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.request import Request, RequestStatus
from kvserve.sched.base import Scheduler, SchedulerState
from kvserve.sched.cost_model import StepBudget
from kvserve.sched.kv_admission import Outcome
from kvserve.sched.output import SchedulerOutput
from kvserve.sched.spec import fit_drafts
from kvserve.sched.step_builder import StepBuilder, chunk_size, is_decode

# Past the ``prefill_budget_with_decodes`` bound a waiting prompt with at most this
# many tokens left to compute still joins the step, whole, while the step budget has
# room (see the module docstring).
SHORT_PROMPT_TOKENS = 128
# Under a time budget, the first prompt chunk of a step with decodes gets at least
# this many tokens (the minimum progress rule; see the module docstring).
MIN_PROMPT_TOKENS_WITH_DECODES = 32
# Under a time budget a later chunk this small that does not finish its prompt is
# left for the next step (a sliver of a prompt costs a row for almost no progress).
MIN_TIMED_CHUNK_TOKENS = 16


class MixedScheduler(Scheduler):
    """One token budget, no phases; prefill chunks and decodes share steps."""

    def schedule(self) -> SchedulerOutput:
        step = self._new_step()
        budget = self.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        cap = threshold if self.get_num_unfinished_requests() > 1 else 0
        preemptions_before = self.num_preemptions

        used = 0  # tokens scheduled so far this step
        ordered = [r for r in self.running if is_decode(r)]
        ordered += [r for r in self.running if not is_decode(r)]
        # streams wait on a step that runs decodes: bound the prompt work in it
        prompt_limit = self.config.prefill_budget_with_decodes
        capped = False
        timed = self.step_time_budget()  # None: token bounds only
        # Draft tokens (speculative decoding) only use budget no prompt work wants:
        # none while a prompt is being computed or one waits for a free sequence slot.
        drafts_ok = not any(not is_decode(r) for r in self.running) and not (
            self.waiting and len(self.running) < self.max_num_seqs
        )
        for request in ordered:
            if prompt_limit and step.decode_ids and not is_decode(request):
                capped = capped or budget > prompt_limit
                budget, prompt_limit = min(budget, prompt_limit), 0
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this step
            wanted = request.num_tokens_with_spec if drafts_ok else request.num_tokens
            num_tokens = chunk_size(wanted - request.num_computed_tokens, budget, cap)
            if timed is not None and step.decode_ids and not is_decode(request):
                num_tokens = _timed_chunk(timed, request, request.num_computed_tokens, num_tokens)
            num_tokens = fit_drafts(self.kv_cache_manager, request, num_tokens)
            if num_tokens <= 0:
                continue
            new_blocks = self._allocate_or_preempt(request, num_tokens, step)
            if new_blocks is None:
                continue
            if timed is not None:
                start = request.num_computed_tokens
                done = start + num_tokens >= request.num_tokens
                timed.add(
                    num_tokens,
                    start,
                    done,
                    prompt=not is_decode(request),
                    short=_is_short(timed, request, start),
                )
            step.add_running(request, num_tokens, new_blocks)
            budget -= num_tokens
            used += num_tokens
        if prompt_limit and step.decode_ids:
            capped = capped or budget > prompt_limit
            budget = min(budget, prompt_limit)
        if not step.decode_ids:
            timed = None  # no stream waits on this step: sized for throughput

        if self.num_preemptions == preemptions_before and self.waiting:
            in_flight = self._in_flight_blocks() if self.enable_prefix_caching else None
            i = 0
            while i < len(self.waiting):
                request = self.waiting[i]
                room: int | Callable[[int], int] = budget
                if timed is not None:
                    room = _timed_room(timed, request, budget, cap)
                elif capped and budget < SHORT_PROMPT_TOKENS:
                    # past the prompt bound: a short prompt still joins, whole, if
                    # the step budget has room (see the module docstring)
                    short = self._uncached_prompt_tokens(request)
                    if short <= min(SHORT_PROMPT_TOKENS, self.max_num_batched_tokens - used):
                        room = max(budget, short)
                if budget <= 0 if callable(room) else room <= 0:
                    break
                if not self._group_fits(request):
                    break
                admission = self._admit(request, room, cap, step, in_flight)
                if admission.stops_admission:
                    break
                if admission.outcome is Outcome.DEFER:
                    i += 1  # its next block is being computed: skip it this step
                    continue
                admitted = admission.num_tokens
                budget = max(0, budget - admitted)
                used += admitted
                if timed is not None and admitted > 0:
                    start = request.num_computed_tokens
                    timed.add(
                        admitted,
                        start,
                        start + admitted >= request.num_tokens,
                        prompt=True,
                        short=_is_short(timed, request, start),
                    )
                if in_flight is not None:
                    self._add_in_flight(request, in_flight)

        return self._build_output(step)

    def _active_state(self, step: StepBuilder) -> SchedulerState:
        return SchedulerState.ACTIVE  # no phases

    def _uncached_prompt_tokens(self, request: Request) -> int:
        """Tokens ``request`` (waiting) would compute to finish its prompt now."""
        if self.kv_cache_manager.holds_blocks(request.req_id):
            return request.num_tokens  # blocks already held (remote KV): no overflow
        _, num_hit = self.kv_cache_manager.get_computed_blocks(request)
        return request.num_tokens - num_hit


def _is_short(timed: StepBudget, request: Request, context: int) -> bool:
    """Whether ``request``'s prompt is short: its whole uncached work (from its prefix
    hit, or ``context`` before it has one, to its end) fits the short target. A long
    prompt's last chunk stays long."""
    start = request.num_cached_tokens if 0 <= request.num_cached_tokens <= context else context
    return timed.is_short(start, request.num_tokens - start)


def _timed_chunk(timed: StepBudget, request: Request, context: int, limit: int) -> int:
    """``limit`` (the chunk the token bounds allow) cut to what fits in ``timed`` at
    ``context``; the step's first prompt chunk keeps at least
    ``MIN_PROMPT_TOKENS_WITH_DECODES`` tokens (the minimum progress rule)."""
    remaining = request.num_tokens - context
    n = timed.prompt_tokens(context, limit, remaining, short=_is_short(timed, request, context))
    if timed.num_prompt_tokens == 0:
        return max(n, min(limit, MIN_PROMPT_TOKENS_WITH_DECODES))
    return n if n >= min(remaining, MIN_TIMED_CHUNK_TOKENS) else 0


def _timed_room(timed: StepBudget, request: Request, budget: int, cap: int) -> Callable[[int], int]:
    """The admission budget of a waiting request under a time budget: given its prefix
    hit (its context), the tokens of its first chunk (see :func:`_timed_chunk`)."""

    def room(context: int) -> int:
        limit = chunk_size(request.num_tokens - context, budget, cap)
        return _timed_chunk(timed, request, context, limit)

    return room
