"""The stream plumbing shared by every OpenAI endpoint: merging an HTTP request's
engine streams, Server-Sent-Event framing, engine errors as OpenAI error bodies.

Callers keep one rule: every stream they merge is drained or aborted
(:func:`abort_all`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from kvserve.engine.async_engine import EngineUnavailableError, RequestFailedError
from kvserve.engine.client import DeltaStream
from kvserve.engine.outputs import RequestDelta
from kvserve.engine.request_limits import RETRY_AFTER_S
from kvserve.entrypoints.openai_errors import APIError


def retry_later(status: int, message: str, code: str) -> APIError:
    """A server-side refusal a client should retry (``Retry-After`` set)."""
    return APIError(
        status,
        message,
        type="server_error",
        code=code,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def check_finish(delta: RequestDelta) -> None:
    """Raise :class:`RequestFailedError` for an abort the client did not ask for."""
    if delta.finish_reason == "abort":
        # The client did not ask for this abort (it would not be reading any more):
        # the engine failed on this request's step.
        raise RequestFailedError(
            "the engine failed while generating this completion; retry the request"
        )


async def merge(streams: Sequence[DeltaStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave several streams as (index, delta) in arrival order."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: DeltaStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        else:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


def sse(data: dict[str, Any] | str) -> str:
    """One Server-Sent Event carrying ``data`` (JSON-encoded unless a string)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def error_event(e: BaseException) -> str:
    """An error body as an event (streams cannot change their status once started)."""
    if isinstance(e, APIError):
        return sse(e.body())
    if isinstance(e, EngineUnavailableError):
        return sse(APIError(503, str(e), type="server_error", code="engine_unavailable").body())
    return sse(
        {
            "error": {
                "message": str(e) or type(e).__name__,
                "type": "server_error",
                "param": None,
                "code": 500,
            }
        }
    )


def abort_all(streams: list[DeltaStream]) -> Callable[[], None]:
    """A callback that aborts every unfinished stream (idempotent)."""

    def _abort() -> None:
        for s in streams:
            s.abort()

    return _abort
