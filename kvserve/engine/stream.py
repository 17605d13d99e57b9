"""What a consumer of :class:`~kvserve.engine.async_engine.AsyncEngine` holds: one
request's :class:`RequestStream` and the errors a stream or ``generate`` raises.

The engine thread puts each :class:`~kvserve.engine.outputs.RequestDelta` (or an
exception) on the request's queue; the stream, on the event loop thread, turns an
error delta into :class:`RequestFailedError` / :class:`KVTransferFailedError`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from kvserve.engine.outputs import RequestDelta
from kvserve.request import FinishReason


class QueueFullError(RuntimeError):
    """No room for the request's sequences beside those already waiting
    (``max_waiting``); retry later (HTTP 429 + Retry-After)."""


class EngineUnavailableError(RuntimeError):
    """The engine is shutting down or its thread died (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request; other requests are unaffected."""


class KVTransferFailedError(RequestFailedError):
    """The request's prompt KV could not be brought from a prefill worker and
    ``--kv-load-failure-policy fail`` ended it (HTTP 503: retry later)."""


class Aborter(Protocol):
    """What a stream needs of its engine: aborting its request (event loop thread)."""

    def abort(self, req_id: str) -> None: ...


@dataclass
class Live:
    """One streamed request: its queue (event loop thread) and the time of its last
    token (engine thread, for the inter-token latency)."""

    queue: asyncio.Queue[Item]
    last_token_time: float | None = None


Item = RequestDelta | BaseException


class RequestStream:
    """The deltas of one request, in order; the last one has ``finished`` set.

    ``async for delta in stream`` ends after the finished delta. Use it as
    ``async with stream:`` (or call :meth:`abort`) so that leaving early - a break,
    an exception, a cancelled task - aborts the request in the engine.
    """

    def __init__(self, engine: Aborter, request_id: str, queue: asyncio.Queue[Item]) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.error is not None:
            self.finished = True
            if item.finish_reason == FinishReason.ERROR:
                raise RequestFailedError(item.error)
            raise KVTransferFailedError(item.error)
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent, event loop thread)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()
