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

The engine thread's half lives in ``engine/engine_loop.py`` (:class:`EngineLoop`,
which this class extends); this module is the event loop's half.

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
import threading
import time

from kvserve.engine.engine_core import EngineCore
from kvserve.engine.engine_loop import AbortCommand, AddCommand, EngineLoop, StopCommand
from kvserve.engine.metrics import EngineMetrics
from kvserve.engine.outputs import EngineStats
from kvserve.engine.request_limits import RefusalReason, Refused, admit_sequences
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
from kvserve.request import Request, RequestError, SamplingParams


class AsyncEngine(EngineLoop):
    """Serve one :class:`EngineCore` to many concurrent asyncio consumers."""

    def __init__(self, engine: EngineCore, *, metrics: EngineMetrics | None = None) -> None:
        super().__init__(
            engine, metrics if metrics is not None else EngineMetrics(engine.model_name)
        )
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.max_num_seqs: int = engine.config.scheduler.max_num_seqs
        self._accepting = True
        self._shutdown_task: asyncio.Future[None] | None = None
        self._thread: threading.Thread | None = None
        # Validate and build a request for submit(), arriving now (any thread may call
        # it; raises RequestError on bad input): EngineCore.make_request itself.
        self.make_request = engine.make_request
        # resident LoRA adapters (thread-safe; kvserve.lora.manager), None: LoRA is off
        self.lora_manager = engine.lora_manager
        self.metrics.set_stats_source(self.stats)
        connector = engine.kv_connector
        if connector is not None:
            # Transfers wake the engine thread (arrivals, claims, leases).
            connector.set_wakeup(self._wake.set)
            self.metrics.set_transfer_source(connector.stats.snapshot)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread, bound to the running event loop. Idempotent."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """False once shutting down or after the engine thread died (whatever its KV
        connector's readiness: a decode replica of a Ray pool serves, prefilling
        locally, before any prefill replica is up)."""
        return (
            self._dead is None
            and self._accepting
            and (self._thread is None or self._thread.is_alive())
        )

    @property
    def is_healthy(self) -> bool:
        """:attr:`is_running`, and its KV connector is ready (False for a decode
        worker whose prefill peer has not answered yet)."""
        connector = self.engine.kv_connector
        return self.is_running and (connector is None or connector.is_ready)

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
        self._submit(StopCommand())
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)
        connector = self.engine.kv_connector
        if connector is not None:
            connector.close()  # its transport threads and sockets
        if not self._thread_alive():  # the KV offload tier: finish its queued writes
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)

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
            self._submit(AddCommand(request, future))
        try:
            results = await asyncio.gather(
                *(asyncio.wrap_future(f) for f in added), return_exceptions=True
            )
        except asyncio.CancelledError:
            self._forget(ids)
            self._submit(AbortCommand(ids))
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._forget(ids)
            self._submit(AbortCommand(ids))  # the ones the engine took: never half-admitted
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
            self._submit(AbortCommand([req_id]))
