"""The HTTP pieces under ``openai_server``'s routes: strict body parsing (off the
event loop when large), answering a :class:`Generation` as one body or as
Server-Sent Events with the engine requests aborted when the client goes, and the
API-key middleware.

Callers keep one rule: whatever :func:`respond` is handed, it owns: it drains the
generation's streams or aborts them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.entrypoints.extras import ignored_header
from kvserve.entrypoints.http_guard import CHAT_EXAMPLE, COMPLETION_EXAMPLE, parse_json_body
from kvserve.entrypoints.openai_errors import APIError, bad_request, validation_error_to_api
from kvserve.entrypoints.openai_serving import Generation, OpenAIServing
from kvserve.entrypoints.serving_streams import abort_all
from kvserve.entrypoints.workers import CpuPool

# Under --api-key every route needs the key except these (load balancers' probes).
OPEN_PATHS = frozenset({"/health"})
M = TypeVar("M", bound=BaseModel)
# Bodies up to this size are parsed on the event loop (a thread hop costs more).
_INLINE_PARSE_BYTES = 64 * 1024


async def parse_body(request: Request, model: type[M], cpu: CpuPool) -> M:
    """The body as ``model`` (``http_guard.parse_json_body`` then strict
    validation), on a worker thread unless it is small; 400 in OpenAI's shape."""
    raw = await request.body()
    if len(raw) <= _INLINE_PARSE_BYTES:
        return validate_body(raw, model)
    return await cpu.run(validate_body, raw, model)


def validate_body(raw: bytes, model: type[M]) -> M:
    """``raw`` as ``model``; 400 in OpenAI's shape. Blocking."""
    data = parse_json_body(
        raw, CHAT_EXAMPLE if "messages" in model.model_fields else COMPLETION_EXAMPLE
    )
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error_to_api(e) from None
    except RecursionError:
        raise bad_request("the request body nests too deeply", code="invalid_json") from None


T = TypeVar("T")


async def respond(
    request: Request,
    serving: OpenAIServing,
    gen: Generation,
    stream: bool,
    ignored: list[str] | None = None,
) -> Response:
    """Stream ``gen`` as Server-Sent Events, or wait for it and answer in one body;
    a client that disconnects has its engine requests aborted (499 when not streamed).
    ``ignored``: request fields named in the ``x-kvserve-ignored-fields`` header."""
    headers = ignored_header(ignored or [])
    if stream:
        return SSEResponse(serving.events(gen), on_close=abort_all(gen.streams), headers=headers)
    choices = await until_disconnect(
        request, serving.collect(gen), on_disconnect=abort_all(gen.streams)
    )
    if choices is None:
        return Response(status_code=499)
    if len(choices) <= 16:
        return JSONResponse(serving.response(gen, choices), headers=headers)
    # Many choices (a batch of prompts): build and encode the body off the event loop.
    body = await serving.cpu.run(lambda: json_bytes(serving.response(gen, choices)))
    return Response(body, media_type="application/json", headers=headers)


def json_bytes(content: Any) -> bytes:
    """What ``JSONResponse`` sends, encoded by the caller's thread."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


async def until_disconnect(
    request: Request, work: Awaitable[T], on_disconnect: Callable[[], None]
) -> T | None:
    """Await ``work``; if the client disconnects first, cancel it, call
    ``on_disconnect`` (abort the engine requests) and return None."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled (server shutdown)
        task.cancel()
        on_disconnect()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    on_disconnect()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return None


class SSEResponse(StreamingResponse):
    """Server-Sent Events that stop - and call ``on_close`` - as soon as the client
    disconnects, whatever the ASGI spec version (Starlette only watches for
    disconnects below 2.4). ``on_close`` also runs if streaming never started."""

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def run(func: Callable[[], Awaitable[None]]) -> None:
                    with contextlib.suppress(OSError):  # client gone while sending
                        await func()
                    tg.cancel_scope.cancel()

                tg.start_soon(run, partial(self.stream_response, send))
                await run(partial(self.listen_for_disconnect, receive))
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


class ApiKeyMiddleware:
    """401 on every route unless ``Authorization: Bearer <api_key>``; the health
    probes (:data:`OPEN_PATHS`) always answer, ``/metrics`` too when ``open_metrics``
    (``--allow-unauthenticated-metrics``: an operator whose scraper has no key says
    so). CORS preflights (``OPTIONS``) pass: they carry no credentials by design."""

    def __init__(self, app: ASGIApp, api_key: str, *, open_metrics: bool = False) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open = OPEN_PATHS | ({"/metrics"} if open_metrics else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if path in self._open:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
                break
        if secrets.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        err = APIError(
            401,
            "missing or wrong API key: send the header 'Authorization: Bearer <key>' with "
            "the key the server was started with (--api-key or KVSERVE_API_KEY)",
            code="invalid_api_key",
        )
        response = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
