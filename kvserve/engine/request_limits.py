"""Engine-front request limits: queue capacity, prompts per request, burst holding.

Does a request get in, wait for its burst, or get refused: typed results, never
sentinels.

    HTTP request: P prompts x S samples (n / best_of) = P*S sequences
      check_prompt_count(P)                   > max_prompts_per_request: RequestError (400)
      admit_sequences(P*S, in_system=...)     Admitted | Refused
          capacity = max_num_seqs + max_queue_len      (running slots + queue)
          P*S > capacity                     Refused(TOO_LARGE)   never fits: 400
          in_system + P*S > capacity         Refused(QUEUE_FULL)  429 + Retry-After
          else                               Admitted(P*S)        all prompts queued
    each queued add, on the engine thread:
      BurstGate.offer(add, busy=...)          AddNow | Held   (held until its burst ends)

A request is admitted whole or refused whole: its sequences are counted together
against what the engine already holds (``in_system``: every unfinished sequence —
running, waiting, waiting for remote KV, samples not yet forked — plus adds handed
over but not yet taken), so one request of 1,000 prompts x n=4 cannot slip past a
queue limit of 2 a prompt at a time. The scheduler's own rules (a group of samples
fits ``max_num_seqs``, a request fits the KV cache) are
:mod:`kvserve.sched.schedulable`; the request's content is validated before any of
this by :mod:`kvserve.engine.validation`.

Rules a caller must keep: count a request's sequences in ``in_system`` from the
moment it is admitted until it finishes (``AsyncEngine`` reserves them under its
lock before queueing the adds); a Refused decision changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvserve.config import BATCH_WAIT_MAX_FACTOR
from kvserve.request import RequestError

# Prompts one completions request may carry by default (--max-prompts-per-request).
# 256 is four full batches at the default max_num_seqs of 64: more buys a client
# nothing over separate requests (the engine runs at most max_num_seqs at once, and
# separate requests interleave fairly with everyone else's), while one huge batch
# would tokenize on the server and hold the FCFS queue for all of it.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
RETRY_AFTER_S = 1


class RefusalReason(enum.StrEnum):
    QUEUE_FULL = "queue_full"  # no room now: retry later (429)
    TOO_LARGE = "too_large"  # more sequences than the engine ever admits (400)


@dataclass(frozen=True)
class Admitted:
    """All ``num_seqs`` sequences of the request may be queued."""

    num_seqs: int


@dataclass(frozen=True)
class Refused:
    """Nothing may be queued; ``message`` says why and how to fix it.
    ``retry_after_s``: set when retrying later can succeed."""

    reason: RefusalReason
    message: str
    retry_after_s: int | None = None


Decision = Admitted | Refused


def check_prompt_count(num_prompts: int, max_prompts_per_request: int | None) -> None:
    """Raise :class:`RequestError` (``param="prompt"``) when one request carries more
    prompts than ``max_prompts_per_request`` (None: no limit)."""
    if max_prompts_per_request is not None and num_prompts > max_prompts_per_request:
        raise RequestError(
            f"the request has {num_prompts} prompts but this server takes at most "
            f"{max_prompts_per_request} per request (--max-prompts-per-request): split it "
            "into several requests",
            param="prompt",
        )


def admit_sequences(
    num_seqs: int, *, in_system: int, max_num_seqs: int, max_queue_len: int | None
) -> Decision:
    """Whether a request of ``num_seqs`` sequences gets in beside the ``in_system``
    sequences the engine holds: at most ``max_num_seqs`` run and at most
    ``max_queue_len`` wait beyond them (None: the queue is unbounded)."""
    if num_seqs < 1:
        raise ValueError(f"a request has at least one sequence, got num_seqs={num_seqs}")
    if max_queue_len is None:
        return Admitted(num_seqs)
    capacity = max_num_seqs + max_queue_len
    if num_seqs > capacity:
        return Refused(
            RefusalReason.TOO_LARGE,
            f"the request needs {num_seqs} sequences (prompts x n/best_of) but this server "
            f"holds at most {capacity} (max_num_seqs {max_num_seqs} running + --max-queue-len "
            f"{max_queue_len} waiting): send fewer prompts or samples per request",
        )
    if in_system + num_seqs > capacity:
        waiting = max(in_system - max_num_seqs, 0)
        return Refused(
            RefusalReason.QUEUE_FULL,
            f"{waiting} sequences are already waiting (the limit is {max_queue_len}) and this "
            f"request needs {num_seqs}: retry after a few seconds",
            RETRY_AFTER_S,
        )
    return Admitted(num_seqs)


# --------------------------------------------------------------------- bursts
T = TypeVar("T")


@dataclass(frozen=True)
class AddNow:
    """Add the request to the engine now."""


@dataclass(frozen=True)
class Held:
    """The gate keeps the request until its burst has arrived (:meth:`BurstGate.release`)."""


class BurstGate(Generic[T]):
    """Adds that reach a busy engine wait here while their burst is still arriving:
    they join the engine together once none has come for ``batch_wait_ms``, the
    oldest has waited ``BATCH_WAIT_MAX_FACTOR`` times that, or the engine has nothing
    else to run. Steps meanwhile carry on with the running requests, so a burst's
    prompts start in one step instead of being split over two, where the first
    half's first inter-token gap is the second half's whole prefill.

    After idling, the engine thread itself waits for the burst
    (:attr:`gap_s`, :attr:`max_wait_s`) before its first step. One thread (the
    engine's) uses a gate; times are ``time.monotonic()`` seconds.
    """

    def __init__(self, batch_wait_ms: float, *, max_factor: float = BATCH_WAIT_MAX_FACTOR) -> None:
        self.gap_s = batch_wait_ms / 1000.0
        self.max_wait_s = self.gap_s * max_factor
        self._held: list[tuple[float, T]] = []

    @property
    def enabled(self) -> bool:
        return self.gap_s > 0

    def __len__(self) -> int:
        return len(self._held)

    def offer(self, item: T, at: float, *, busy: bool) -> AddNow | Held:
        """An add handed over at ``at``: hold it when bursts are waited for and the
        engine is ``busy`` (has unfinished requests), else add it now."""
        if self.enabled and busy:
            self._held.append((at, item))
            return Held()
        return AddNow()

    def release(self, now: float, *, busy: bool) -> list[T]:
        """The held adds whose burst is over (all of them, or none), oldest first."""
        if not self._held:
            return []
        newest, oldest = self._held[-1][0], self._held[0][0]
        if busy and now - newest < self.gap_s and now - oldest < self.max_wait_s:
            return []
        return self.take_all()

    def remove_where(self, pred: Callable[[T], bool]) -> list[T]:
        """Take out and return the held items for which ``pred`` is true (aborts)."""
        taken = [item for _, item in self._held if pred(item)]
        if taken:
            self._held = [(at, item) for at, item in self._held if not pred(item)]
        return taken

    def take_all(self) -> list[T]:
        held, self._held = self._held, []
        return [item for _, item in held]
