"""KV admission: one waiting request to running (prefix lookup, KV blocks), typed.

What :meth:`Scheduler._admit` decides each step.

A waiting request (usually the head of ``waiting``) is looked up in the prefix cache,
then one of four things happens, each an :class:`Outcome`:

- ``RUN``: its first chunk's blocks were allocated; it moves to ``running`` with
  :attr:`Admission.num_tokens` tokens scheduled this step.
- ``PARK``: the KV connector will load part of its prompt from outside; blocks for
  those tokens were allocated and it waits in ``waiting_for_remote`` (nothing is
  computed this step, ``num_tokens`` is 0).
- ``DEFER``: the blocks it would compute first are being computed by a running
  request (*in flight*, more than :data:`DEFER_MIN_IN_FLIGHT_TOKENS` of them in a
  row). Nothing changed; the caller admits later requests past it, and a step later
  those blocks are prefix-cache hits, so a burst on one new shared prefix computes
  it once. The deferral ends when the blocks are cached or their owner stops
  computing them (finished, preempted, aborted), so it cannot starve.
- ``NO_FIT``: its budget or its blocks do not fit. Nothing changed; FCFS admission
  stops here.

The in-flight set is the hashes of the full prompt blocks running requests have not
computed yet (:func:`in_flight_blocks`; the caller extends it with
:func:`add_in_flight` as it admits more in the same step).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvserve.kv_cache.blocks import EMPTY
from kvserve.kv_cache.hashing import BlockHash
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sched.remote_kv import RemoteKV
from kvserve.sched.step_builder import chunk_size

# A waiting request is deferred only when more than this many of the tokens it would
# compute next are being computed by a running request: recomputing a short tail
# (a shared prefix's last blocks, in flight beside their owner's own suffix) costs
# less than starting a step later, which also splits a burst's prompts over two
# steps and gives the first half a whole prefill step as its first inter-token gap.
DEFER_MIN_IN_FLIGHT_TOKENS = 128


class Outcome(enum.Enum):
    """What admitting one waiting request did (see the module docstring)."""

    RUN = "run"
    PARK = "park"
    DEFER = "defer"
    NO_FIT = "no_fit"


@dataclass(frozen=True, slots=True)
class Admission:
    """The result of :meth:`Scheduler._admit`: the outcome and, for ``RUN``, the
    tokens scheduled this step (0 for every other outcome)."""

    outcome: Outcome
    num_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or (self.num_tokens and self.outcome is not Outcome.RUN):
            raise ValueError(
                f"Admission({self.outcome}, num_tokens={self.num_tokens}): only RUN schedules "
                "tokens, and never a negative count"
            )

    @property
    def stops_admission(self) -> bool:
        """True when FCFS admission must stop at this request (it did not fit)."""
        return self.outcome is Outcome.NO_FIT

    @property
    def changed(self) -> bool:
        """True when the request left ``waiting`` (it runs, or waits for remote KV)."""
        return self.outcome in (Outcome.RUN, Outcome.PARK)


NO_FIT = Admission(Outcome.NO_FIT)
DEFER = Admission(Outcome.DEFER)
PARK = Admission(Outcome.PARK)


def run(num_tokens: int) -> Admission:
    """A ``RUN`` result with ``num_tokens`` (> 0) scheduled."""
    if num_tokens <= 0:
        raise ValueError(f"run({num_tokens}): a request that runs schedules at least one token")
    return Admission(Outcome.RUN, num_tokens)


def add_in_flight(request: Request, in_flight: set[BlockHash], block_size: int) -> None:
    """Add ``request``'s full prompt blocks not computed yet to ``in_flight``."""
    if request.num_computed_tokens >= request.num_prompt_tokens:
        return
    end = min(request.num_prompt_tokens // block_size, len(request.block_hashes))
    in_flight.update(request.block_hashes[request.num_computed_tokens // block_size : end])


def in_flight_blocks(running: Iterable[Request], block_size: int) -> set[BlockHash]:
    """Hashes of the full prompt blocks that ``running`` requests have not computed yet
    (they compute them this step or a later one)."""
    in_flight: set[BlockHash] = set()
    for request in running:
        add_in_flight(request, in_flight, block_size)
    return in_flight


def in_flight_tokens(
    request: Request, num_hit_blocks: int, in_flight: set[BlockHash], block_size: int
) -> int:
    """Tokens in the run of blocks ``request`` would compute first (after its
    ``num_hit_blocks`` prefix-cache hits) that are in ``in_flight``. Only blocks
    before the last token count: that one is always computed by the request itself."""
    hashes: Sequence[BlockHash] = request.block_hashes
    limit = min((request.num_tokens - 1) // block_size, len(hashes))
    shared = num_hit_blocks
    while shared < limit and hashes[shared] in in_flight:
        shared += 1
    return (shared - num_hit_blocks) * block_size


def should_defer(
    request: Request, num_hit_blocks: int, in_flight: set[BlockHash] | None, block_size: int
) -> bool:
    """Whether ``request`` waits a step for blocks in flight (see the module docstring)."""
    if not in_flight:
        return False
    tokens = in_flight_tokens(request, num_hit_blocks, in_flight, block_size)
    return tokens > DEFER_MIN_IN_FLIGHT_TOKENS


Budget = int | Callable[[int], int]
"""A token count, or a function of a request's context (its prefix hit) giving one (a
time budget: longer contexts cost more per token)."""


class Admitter:
    """Decides and allocates one waiting request's admission; the scheduler moves it
    between its queues by the :class:`Admission` it returns.

    On ``RUN`` the request holds blocks for its first chunk, its status is RUNNING and
    ``num_computed_tokens`` is its prefix hit; on ``PARK`` it holds blocks for the
    external tokens and is in ``remote_kv.waiting``. ``DEFER`` and ``NO_FIT`` change
    nothing. Call :meth:`admit` right before queueing the result: no other allocation
    may come between the prefix lookup and the allocation it makes.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        remote_kv: RemoteKV,
        clock: Callable[[], float],
        *,
        enable_prefix_caching: bool,
    ) -> None:
        self.kv = kv
        self.remote_kv = remote_kv
        self.clock = clock
        self.enable_prefix_caching = enable_prefix_caching

    def admit(
        self, request: Request, budget: Budget, cap: int, in_flight: set[BlockHash] | None
    ) -> Admission:
        """Prefix lookup, the in-flight check (only with ``in_flight``), the
        connector's external tokens, then one ``allocate_slots`` for the first chunk
        (``chunk_size`` of what is left, ``budget`` and ``cap``)."""
        kv = self.kv
        if kv.holds_blocks(request.req_id):
            return self._admit_loaded(request, budget, cap)
        if self.enable_prefix_caching:
            hit_blocks, num_hit = kv.get_computed_blocks(request)
        else:
            hit_blocks, num_hit = EMPTY, 0
        if should_defer(request, len(hit_blocks), in_flight, kv.block_size):
            return DEFER
        num_external = self.remote_kv.num_external_tokens(request, num_hit)
        if num_external > 0:
            # Blocks for the external tokens only; nothing is computed until they arrive.
            if kv.allocate_slots(request, num_external, hit_blocks, num_hit) is None:
                return NO_FIT
            self._start(request, num_hit)
            self.remote_kv.park(request, num_external)
            return PARK
        if callable(budget):
            budget = budget(num_hit)
        num_new = chunk_size(request.num_tokens - num_hit, budget, cap)
        if num_new <= 0 or kv.allocate_slots(request, num_new, hit_blocks, num_hit) is None:
            return NO_FIT
        request.status = RequestStatus.RUNNING
        self._start(request, num_hit)
        self.remote_kv.allocated(request, kv.get_block_ids(request.req_id))
        return run(num_new)

    def _start(self, request: Request, num_hit: int) -> None:
        """Stamp a request leaving ``waiting`` with its ``num_hit`` prefix-cache hit."""
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()

    def _admit_loaded(self, request: Request, budget: Budget, cap: int) -> Admission:
        """A request back from a remote load already holds its blocks and
        ``num_computed_tokens`` counts what arrived: compute the rest."""
        if callable(budget):
            budget = budget(request.num_computed_tokens)
        num_new = chunk_size(request.num_tokens - request.num_computed_tokens, budget, cap)
        if num_new <= 0 or self.kv.allocate_slots(request, num_new) is None:
            return NO_FIT
        request.status = RequestStatus.RUNNING
        return run(num_new)
