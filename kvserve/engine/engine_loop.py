"""The engine thread of :class:`~kvserve.engine.async_engine.AsyncEngine`: the only
thread that touches :class:`EngineCore`.

It takes commands (:class:`AddCommand`, :class:`AbortCommand`,
:class:`StopCommand`) queued by the event loop thread, holds the adds of a burst
still arriving (``engine/request_limits.py``'s :class:`BurstGate`), steps the engine,
records latency metrics from each delta and hands the deltas back to the event
loop (``call_soon_threadsafe``), where :meth:`EngineLoop._dispatch` puts them on
the requests' queues.

Rules a subclass keeps: ``_requests`` is written only on the event loop thread
(the engine thread reads it and writes ``last_token_time``); ``_lock`` guards
``_commands``, ``_stats`` and ``_num_pending_seqs``; every add taken is answered
on its future (a request id, or the error that refused it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.engine.engine_core import EngineCore
from kvserve.engine.memory import IdleTrimmer
from kvserve.engine.metrics import EngineMetrics
from kvserve.engine.outputs import EngineStats, RequestDelta
from kvserve.engine.request_limits import AddNow, BurstGate
from kvserve.engine.stream import EngineUnavailableError, Live, RequestFailedError
from kvserve.request import Request, RequestError

logger = logging.getLogger("kvserve.engine.async_engine")


@dataclass
class AddCommand:
    """Queue ``request`` (built and validated by ``EngineCore.make_request``); ``at``:
    when it was handed over (``time.monotonic``)."""

    request: Request
    added: concurrent.futures.Future[str]
    at: float = field(default_factory=time.monotonic)


@dataclass
class AbortCommand:
    """Abort these requests (held adds included)."""

    req_ids: list[str]


@dataclass
class StopCommand:
    """Abort whatever is still live, end those streams with an abort delta, stop."""


Command = AddCommand | AbortCommand | StopCommand


def adds_for(ids: set[str]) -> Callable[[AddCommand], bool]:
    """Whether an add queues one of ``ids``."""
    return lambda command: command.request.req_id in ids


class EngineLoop:
    """The engine-thread half of :class:`AsyncEngine` (and the hand-off of deltas to
    the event loop)."""

    def __init__(self, engine: EngineCore, metrics: EngineMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._lock = threading.Lock()  # guards the fields below shared by both threads
        self._commands: deque[Command] = deque()
        self._num_pending_seqs = 0  # sequences of adds not yet taken by the engine thread
        self._stats: EngineStats = engine.stats()
        self._wake = threading.Event()
        self._stop = False
        self._dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requests: dict[str, Live] = {}  # see the module docstring
        # Adds of a burst still arriving (engine thread); see engine/request_limits.py.
        engine.config.admission.validate()
        self._burst: BurstGate[AddCommand] = BurstGate(engine.config.admission.batch_wait_ms)
        self._trimmer = IdleTrimmer()  # memory back to the OS after 2 idle minutes

    def _submit(self, command: Command) -> None:
        with self._lock:
            self._commands.append(command)
        self._wake.set()

    def _run(self) -> None:
        try:
            idle = True
            while not self._stop:
                self._drain_commands()
                if self._stop:
                    break
                self._release_held()
                if not self.engine.has_unfinished_requests():
                    idle = True
                    self._poll_transfers()
                    self._refresh_stats()
                    self._trimmer.tick(time.monotonic(), idle=True)
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                self._trimmer.tick(time.monotonic(), idle=False)
                if idle:
                    idle = False
                    self._await_burst()
                self._step()
                if self.engine.last_step_idle:
                    # Only remote loads pending: sleep until something arrives.
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
        except BaseException as e:  # the thread must not die silently
            logger.exception("engine thread died")
            self._dead = e
            self._fail(list(self._requests), EngineUnavailableError(f"the engine thread died: {e}"))
            self._fail_held(EngineUnavailableError(f"the engine thread died: {e}"))
        finally:
            self._refresh_stats()

    def _await_burst(self) -> None:
        """After idling: take commands until none has come for ``batch_wait_ms`` (at
        most ``BATCH_WAIT_MAX_FACTOR`` times it), so that a burst's first step holds
        all of it rather than the first request alone (engine thread)."""
        gap = self._burst.gap_s
        if gap <= 0:
            return
        deadline = time.monotonic() + self._burst.max_wait_s
        while not self._stop:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._wake.wait(timeout=min(gap, remaining)):
                return
            self._wake.clear()
            self._drain_commands(hold=False)

    def _drain_commands(self, *, hold: bool = True) -> None:
        """Apply queued commands; with ``hold``, adds reaching a busy engine are held
        (:class:`~kvserve.engine.request_limits.BurstGate`)."""
        while True:
            with self._lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
            match command:
                case AddCommand(request, added):
                    busy = hold and self.engine.has_unfinished_requests()
                    if isinstance(self._burst.offer(command, command.at, busy=busy), AddNow):
                        self._do_add(request, added)
                case AbortCommand(req_ids):
                    for c in self._burst.remove_where(adds_for(set(req_ids))):
                        self._fail_add(c, RequestError("the request was aborted"))
                    aborted = self.engine.abort_requests(req_ids)
                    if aborted:
                        for delta in aborted:
                            self._record(delta)
                        self._refresh_stats()
                case StopCommand():
                    self._stop = True
                    cut = EngineUnavailableError(
                        "the server shut down before this request finished; retry it"
                    )
                    self._fail_held(cut)
                    aborted = self.engine.abort_requests(list(self._requests))
                    for delta in aborted:
                        self._record(delta)
                    self._fail([d.request_id for d in aborted], cut, count=False)
                    return

    def _poll_transfers(self) -> None:
        """Idle engine: still apply claims, leases and failed loads."""
        failed = self.engine.poll_kv_transfer()
        if failed:
            for delta in failed:
                self._record(delta)
            self._deliver(failed)

    def _release_held(self) -> None:
        """Add the held adds whose burst is over (engine thread)."""
        busy = self.engine.has_unfinished_requests()
        for command in self._burst.release(time.monotonic(), busy=busy):
            self._do_add(command.request, command.added)

    def _fail_held(self, error: BaseException) -> None:
        for command in self._burst.take_all():
            self._fail_add(command, error)

    def _fail_add(self, command: AddCommand, error: BaseException) -> None:
        with self._lock:
            self._num_pending_seqs -= len(command.request.group)
        if not command.added.done():
            command.added.set_exception(error)

    def _do_add(self, request: Request, added: concurrent.futures.Future[str]) -> None:
        try:
            self.engine.add(request)
        except BaseException as e:
            self._fail_add(AddCommand(request, added), e)
            return
        self._refresh_stats(pending_delta=-len(request.group))
        added.set_result(request.req_id)

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as e:
            # A scheduler bug: fail the requests we know about, keep the engine if it
            # can still abort them (which frees their blocks).
            logger.exception("engine step failed; failing the engine's requests")
            failed = [d.request_id for d in self.engine.abort_requests(list(self._requests))]
            self._fail(
                failed, RequestFailedError(f"the engine failed while running this request: {e}")
            )
            self._refresh_stats()
            return
        for delta in deltas:
            self._record(delta)
        self._refresh_stats()
        if deltas:
            self._deliver(deltas)

    def _record(self, delta: RequestDelta) -> None:
        """Latency histograms and counters from the delta's own timestamps (the
        scheduler's clock): TTFT on the step of the first token, ITL from the
        previous token step of the same request, e2e when it finishes. Each sample of
        an ``n > 1`` request counts as a request; its prompt tokens count once."""
        m = delta.metrics
        n = len(delta.new_token_ids)
        if n and m is not None and m.last_token_time is not None:
            live = self._requests.get(delta.request_id)
            if m.first_token_time == m.last_token_time:
                if delta.sample_index == 0:
                    self.metrics.count_prompt_tokens(delta.num_prompt_tokens)
                    self.metrics.count_prompt_tokens_by_source(
                        local_cache_hit=delta.num_cached_tokens,
                        external_kv_transfer=delta.num_external_tokens,
                        local_compute=delta.num_prompt_tokens
                        - delta.num_cached_tokens
                        - delta.num_external_tokens,
                    )
                self.metrics.observe_ttft(m.last_token_time - m.arrival_time)
            elif live is not None and live.last_token_time is not None:
                self.metrics.observe_itl((m.last_token_time - live.last_token_time) / n)
            if live is not None:
                live.last_token_time = m.last_token_time
        if n:
            self.metrics.count_generation_tokens(n)
        if delta.finished:
            self.metrics.count_finished("error" if delta.error else str(delta.finish_reason))
            if m is not None and m.finished_time is not None:
                self.metrics.observe_e2e(m.finished_time - m.arrival_time)

    def _refresh_stats(self, pending_delta: int = 0) -> None:
        try:
            stats: EngineStats | None = self.engine.stats()
        except Exception:  # stats must never take the engine down
            logger.exception("EngineCore.stats() failed")
            stats = None
        with self._lock:
            if stats is not None:
                self._stats = stats
            self._num_pending_seqs += pending_delta

    def _deliver(self, items: list[RequestDelta]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closed meanwhile
                loop.call_soon_threadsafe(self._dispatch, items)

    def _fail(self, req_ids: list[str], error: BaseException, *, count: bool = True) -> None:
        for _ in req_ids if count else ():
            self.metrics.count_finished("error")
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._dispatch_error, req_ids, error)

    # ------------------------------------------------------------------ event loop side
    def _dispatch(self, items: list[RequestDelta]) -> None:
        for delta in items:
            live = self._requests.get(delta.request_id)
            if live is not None:
                live.queue.put_nowait(delta)
                if delta.finished:
                    del self._requests[delta.request_id]

    def _dispatch_error(self, req_ids: list[str], error: BaseException) -> None:
        for r in req_ids:
            live = self._requests.pop(r, None)
            if live is not None:
                live.queue.put_nowait(error)
