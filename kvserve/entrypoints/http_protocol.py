"""uvicorn's httptools protocol with connection-level bounds.

uvicorn alone bounds neither a request's header bytes nor the time its headers
take (slowloris). :class:`GuardedHttpProtocol` adds, per connection:

    max_header_bytes   the request line and headers of one request may take at
                       most this many bytes, else **431** and the connection closes
                       (``--max-header-bytes``, default 32 KiB)
    header_timeout_s   from the connection's first byte (or its accept) to the end
                       of the headers, at most this long, else **408** and close
                       (``--header-timeout``, default 10 s)
    max_connections    a connection accepted while this many are open is answered
                       **503** + ``Retry-After`` and closed at once, before it can
                       hold anything (``--limit-concurrency``, default 1024; uvicorn's
                       own ``limit_concurrency`` also answers 503 past that many
                       requests in progress)

Idle keep-alive connections are closed after uvicorn's ``timeout_keep_alive``
(``--timeout-keep-alive``, default 5 s). Build the class with :func:`guarded_protocol`
and hand it to ``uvicorn.Config(http=...)``; every limit is fixed when it is built.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_MAX_HEADER_BYTES = 32 * 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 1024

_REASONS = {
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def _raw_error(status: int, message: str, code: str, extra: str = "") -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode("ascii") + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """See the module docstring; the class attributes are set by :func:`guarded_protocol`."""

    max_header_bytes = DEFAULT_MAX_HEADER_BYTES
    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    max_connections = DEFAULT_MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_bytes: int | None = 0  # None: the current request's headers are in
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(
                503,
                f"the server holds its limit of {self.max_connections} connections: retry in a "
                "moment (the operator sets it with --limit-concurrency)",
                "too_many_connections",
                "retry-after: 1\r\n",
            )
            return
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._header_bytes is not None and not self.transport.is_closing():
            self._refuse(
                408,
                f"the request headers did not arrive within {self.header_timeout_s:g} s",
                "header_timeout",
            )

    def _refuse(self, status: int, message: str, code: str, extra: str = "") -> None:
        self._cancel_header_timer()
        self._header_bytes = None
        if not self.transport.is_closing():
            self.transport.write(_raw_error(status, message, code, extra))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._header_bytes is not None:
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes + len(data):  # already past it
                self._too_large()
                return
        super().data_received(data)
        if self._header_bytes is not None and self._header_bytes > self.max_header_bytes:
            self._too_large()

    def _too_large(self) -> None:
        self._refuse(
            431,
            f"the request line and headers are larger than this server's limit of "
            f"{self.max_header_bytes} bytes: send fewer or shorter headers (the operator "
            "sets the limit with --max-header-bytes)",
            "header_too_large",
        )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._header_bytes = None
        self._cancel_header_timer()
        super().on_headers_complete()


def guarded_protocol(
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> type[GuardedHttpProtocol]:
    """A :class:`GuardedHttpProtocol` subclass with these limits; ValueError (with the
    flag to fix) for a value out of range."""
    if max_header_bytes < 1024:
        raise ValueError(f"--max-header-bytes must be >= 1024, got {max_header_bytes}")
    if not header_timeout_s > 0:
        raise ValueError(f"--header-timeout must be > 0 seconds, got {header_timeout_s}")
    if max_connections < 1:
        raise ValueError(f"--limit-concurrency must be >= 1, got {max_connections}")
    attrs = {
        "max_header_bytes": max_header_bytes,
        "header_timeout_s": header_timeout_s,
        "max_connections": max_connections,
    }
    return type("BoundedHttpProtocol", (GuardedHttpProtocol,), attrs)
