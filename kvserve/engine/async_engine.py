"""Asyncio front over :class:`EngineCore`: the engine steps in a background thread.

    event loop thread                           engine thread (the only one touching EngineCore)
    ─────────────────                           ──────────────────────────────────────────────
    generate() ── _Add / _Abort / _Stop ──▶ commands ──▶ EngineCore.add / abort_requests
       ▲                                            │
       │   per-request asyncio.Queue                ▼
       └──── call_soon_threadsafe(dispatch) ◀── step() -> list[RequestDelta]
                                                    │
                                                 stats() snapshot, metrics (TTFT/ITL/e2e
                                                 from RequestDelta.metrics)

One map, ``_requests``, holds the requests this front streams (added on the event
loop thread before their add is queued, removed there when their stream ends); the
engine thread only reads it and writes ``last_token_time``. EngineCore keeps its own
state per request and builds every delta, abort deltas included.

Rules a caller must keep:
- Call :meth:`start` from the event loop that will consume the streams (or let the
  first :meth:`generate` do it). All streams are delivered on that loop.
- :meth:`shutdown` drains: new requests are refused at once, in-flight ones get up
  to ``drain_timeout_s``, the rest are cut (their streams raise
  :class:`EngineUnavailableError`, which the server turns into an error event then
  ``[DONE]``, or a 503).
- ``generate`` raises before yielding anything when the request is refused:
  :class:`~kvserve.request.RequestError` (a ValueError: bad request, the message says
  what to change, ``param`` names the field), :class:`QueueFullError`
  (waiting queue at its limit), :class:`EngineUnavailableError` (shutting down or
  the engine thread died).
- ``generate`` returns a :class:`RequestStream`. A consumer that stops reading
  before the finished delta (client disconnected, task cancelled) must call
  ``stream.abort()`` or read it inside ``async with stream:``; the engine thread
  then aborts the request before its next step, which frees its KV blocks.
- A request whose step failed inside the engine gets :class:`RequestFailedError`
  from its stream; the other requests and the engine go on.
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
from typing import Any

from kvserve.engine.admission import (
    AddNow,
    BurstGate,
    RefusalReason,
    Refused,
    admit_sequences,
)
from kvserve.engine.engine_core import EngineCore
from kvserve.engine.memory import IdleTrimmer
from kvserve.engine.outputs import EngineStats, RequestDelta
from kvserve.engine.stream import (
    EngineUnavailableError as EngineUnavailableError,
)
from kvserve.engine.stream import (
    KVTransferFailedError as KVTransferFailedError,
)
from kvserve.engine.stream import Live
from kvserve.engine.stream import (
    QueueFullError as QueueFullError,
)
from kvserve.engine.stream import (
    RequestFailedError as RequestFailedError,
)
from kvserve.engine.stream import (
    RequestStream as RequestStream,
)
from kvserve.engine.threads import run_in_scratch_thread as run_in_scratch_thread
from kvserve.metrics import EngineMetrics
from kvserve.request import Request, RequestError, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    """Queue ``request`` (built and validated by ``EngineCore.make_request``); ``at``:
    when it was handed over (``time.monotonic``)."""

    request: Request
    added: concurrent.futures.Future[str]
    at: float = field(default_factory=time.monotonic)


@dataclass
class _Abort:
    req_ids: list[str]


@dataclass
class _Stop:
    """Abort whatever is still live, end those streams with an abort delta, stop."""


_Command = _Add | _Abort | _Stop


def _for_ids(ids: set[str]) -> Callable[[_Add], bool]:
    """Whether an add queues one of ``ids``."""
    return lambda command: command.request.req_id in ids


class AsyncEngine:
    """Serve one :class:`EngineCore` to many concurrent asyncio consumers."""

    def __init__(self, engine: EngineCore, *, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else EngineMetrics(engine.model_name)
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.max_num_seqs: int = engine.config.scheduler.max_num_seqs

        self._lock = threading.Lock()  # guards the fields below shared by both threads
        self._commands: deque[_Command] = deque()
        self._num_pending_seqs = 0  # sequences of adds not yet taken by the engine thread
        self._stats: EngineStats = engine.stats()
        self._wake = threading.Event()
        self._stop = False
        self._dead: BaseException | None = None
        self._accepting = True
        self._shutdown_task: asyncio.Future[None] | None = None

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._requests: dict[str, Live] = {}  # see the module docstring
        # Adds of a burst still arriving (engine thread); see engine/admission.py.
        engine.config.admission.validate()
        self._burst: BurstGate[_Add] = BurstGate(engine.config.admission.batch_wait_ms)
        self._trimmer = IdleTrimmer()  # memory back to the OS after 2 idle minutes
        # Validate and build a request for submit(), arriving now (any thread may call
        # it; raises RequestError on bad input): EngineCore.make_request itself.
        self.make_request = engine.make_request
        self.metrics.set_stats_source(self.stats)
        connector = engine.kv_connector
        if connector is not None:
            # Transfers wake the engine thread (arrivals, claims, leases).
            connector.set_wakeup(self._wake.set)
            self.metrics.set_transfer_source(connector.stats.snapshot)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def from_options(cls, **engine_options: Any) -> AsyncEngine:
        """Build the engine from flat engine options (``kvserve.engine.args``)."""
        from kvserve.engine.args import build_engine_config

        config = build_engine_config(**engine_options)
        return cls(run_in_scratch_thread(lambda: EngineCore(config)))

    def start(self) -> None:
        """Start the engine thread, bound to the running event loop. Idempotent."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        """False once shutting down, after the engine thread died, or while its KV
        connector is not ready (a decode worker whose prefill peer has not answered
        yet)."""
        connector = self.engine.kv_connector
        return (
            self._dead is None
            and self._accepting
            and (self._thread is None or self._thread.is_alive())
            and (connector is None or connector.is_ready)
        )

    @property
    def num_in_flight(self) -> int:
        """Requests this front is streaming (event loop thread)."""
        return len(self._requests)

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting requests, let in-flight ones finish for up to ``drain_timeout_s``
        seconds (returning as soon as none is left), cut the rest (aborted in the
        engine, their KV blocks freed; their streams raise
        :class:`EngineUnavailableError`) and stop the engine thread. A second call
        waits for the first one's end."""
        self._accepting = False
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(drain_timeout_s))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, drain_timeout_s: float) -> None:
        deadline = time.monotonic() + drain_timeout_s
        while self._requests and time.monotonic() < deadline and self._thread_alive():
            await asyncio.sleep(0.02)
        self._submit(_Stop())
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)
        connector = self.engine.kv_connector
        if connector is not None:
            connector.close()  # its transport threads and sockets

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ queries
    def stats(self) -> EngineStats:
        """The latest ``EngineCore.stats()`` snapshot (refreshed after every step)."""
        with self._lock:
            return self._stats

    async def render_metrics(self) -> bytes:
        """This engine's series in Prometheus text format (``/metrics``)."""
        return self.metrics.render()

    def num_waiting(self) -> int:
        """Sequences queued but not yet running: the engine's waiting sequences
        (remote-KV waits and samples not yet forked included) plus those of adds not
        yet taken by the engine thread. Never undercounts."""
        with self._lock:
            stats = self._stats
            return stats.num_seqs_unfinished - stats.num_requests_running + self._num_pending_seqs

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
        max_waiting: int | None = None,
    ) -> RequestStream:
        """Queue a request; return the stream of its deltas (the last one is finished).

        ``max_waiting``: refuse with :class:`QueueFullError` when :meth:`num_waiting`
        is already at least this many. See the module docstring for the errors.
        """
        self._check_available()
        request = self.make_request(
            prompt_token_ids, params, request_id=request_id, prompt=prompt, cache_salt=cache_salt
        )
        return await self.submit(request, max_waiting=max_waiting)

    async def submit(self, request: Request, *, max_waiting: int | None = None) -> RequestStream:
        """Queue a request built by :meth:`make_request` (it is not validated again);
        return the stream of its first sample (:meth:`submit_samples` returns all).
        Raises as :meth:`generate` does."""
        return (await self.submit_samples(request, max_waiting=max_waiting))[0]

    async def submit_samples(
        self, request: Request, *, max_waiting: int | None = None
    ) -> list[RequestStream]:
        """Queue a request built by :meth:`make_request` and return one stream per
        sample (``n``/``best_of``; ``request.group`` order). Aborting a stream aborts
        that sample; the caller must drain or abort every stream."""
        return (await self.submit_all([request], max_waiting=max_waiting))[0]

    async def submit_all(
        self, requests: list[Request], *, max_waiting: int | None = None
    ) -> list[list[RequestStream]]:
        """Queue the requests of one HTTP request (several prompts), all or none:
        their sequences are admitted together (:func:`admit_sequences` against
        ``max_num_seqs`` + ``max_waiting``) or :class:`QueueFullError` /
        :class:`RequestError` is raised and nothing is queued. If the engine refuses
        one of them when it takes it (an id in use, a request that cannot fit the KV
        cache), the others are aborted and that error raised. Returns the streams of
        each request's samples, request by request."""
        self._check_available()
        ids = [r.req_id for request in requests for r in request.group]
        if len(set(ids)) != len(ids) or any(r in self._requests for r in ids):
            raise RequestError(
                f"request id {requests[0].req_id!r} is already in use: pick a unique id",
                param="request_id",
            )
        with self._lock:
            stats = self._stats
            decision = admit_sequences(
                len(ids),
                in_system=stats.num_seqs_unfinished + self._num_pending_seqs,
                max_num_seqs=self.max_num_seqs,
                max_queue_len=max_waiting,
            )
            if isinstance(decision, Refused):
                self.metrics.count_rejected()
                if decision.reason is RefusalReason.QUEUE_FULL:
                    raise QueueFullError(decision.message)
                raise RequestError(decision.message, param="n", code="too_many_sequences")
            self._num_pending_seqs += decision.num_seqs
        lives = [Live(asyncio.Queue()) for _ in ids]
        self._requests.update(zip(ids, lives, strict=True))
        added: list[concurrent.futures.Future[str]] = []
        for request in requests:
            future: concurrent.futures.Future[str] = concurrent.futures.Future()
            added.append(future)
            self._submit(_Add(request, future))
        try:
            results = await asyncio.gather(
                *(asyncio.wrap_future(f) for f in added), return_exceptions=True
            )
        except asyncio.CancelledError:
            self._forget(ids)
            self._submit(_Abort(ids))
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._forget(ids)
            self._submit(_Abort(ids))  # the ones the engine took: never half-admitted
            raise errors[0]
        streams = [RequestStream(self, r, live.queue) for r, live in zip(ids, lives, strict=True)]
        out, i = [], 0
        for request in requests:
            out.append(streams[i : i + len(request.group)])
            i += len(request.group)
        return out

    def _forget(self, ids: list[str]) -> None:
        for r in ids:
            self._requests.pop(r, None)

    def _check_available(self) -> None:
        self.start()
        if self._dead is not None:
            raise EngineUnavailableError(
                f"the engine stopped after an internal error: {self._dead}"
            )
        if not self._accepting:
            raise EngineUnavailableError("the server is shutting down; retry on another replica")

    def abort(self, req_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its stream ends without a
        further delta. Call from the event loop thread."""
        if self._requests.pop(req_id, None) is not None:
            self._submit(_Abort([req_id]))

    # ------------------------------------------------------------------ engine thread
    def _submit(self, command: _Command) -> None:
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
        (:class:`~kvserve.engine.admission.BurstGate`)."""
        while True:
            with self._lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
            match command:
                case _Add(request, added):
                    busy = hold and self.engine.has_unfinished_requests()
                    if isinstance(self._burst.offer(command, command.at, busy=busy), AddNow):
                        self._do_add(request, added)
                case _Abort(req_ids):
                    for c in self._burst.remove_where(_for_ids(set(req_ids))):
                        self._fail_add(c, RequestError("the request was aborted"))
                    aborted = self.engine.abort_requests(req_ids)
                    if aborted:
                        for delta in aborted:
                            self._record(delta)
                        self._refresh_stats()
                case _Stop():
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

    def _fail_add(self, command: _Add, error: BaseException) -> None:
        with self._lock:
            self._num_pending_seqs -= len(command.request.group)
        if not command.added.done():
            command.added.set_exception(error)

    def _do_add(self, request: Request, added: concurrent.futures.Future[str]) -> None:
        try:
            self.engine.add(request)
        except BaseException as e:
            self._fail_add(_Add(request, added), e)
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
