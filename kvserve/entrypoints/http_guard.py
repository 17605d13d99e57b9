"""What the HTTP layer checks before a request body reaches a route.

- :class:`BodyGuardMiddleware` (ASGI): on every request to a JSON route
  (``is_json_route(method, path)``: the app's POST routes) the ``Content-Type``
  must be JSON (``application/json`` or ``*/*+json``),
  else **415**: a browser page can only send ``text/plain``, form or multipart
  bodies cross-site without a CORS preflight, so refusing them keeps a server
  without an API key from being driven by any web page its users visit. The body
  may be at most ``max_body_bytes``: a ``Content-Length`` above it is answered
  **413** before any of the body is read; a body without one (chunked) is counted
  while it streams and refused the moment it passes the limit. The body read here
  is handed to the route unchanged.
- :func:`parse_json_body`: the body as a JSON object, or a 400 in OpenAI's shape:
  invalid JSON or UTF-8, nesting deeper than :data:`MAX_JSON_DEPTH` (the C parser
  would raise RecursionError at ~1,000 levels; 128 is far beyond any real request
  yet cheap to walk), and strings or keys holding a lone UTF-16 surrogate
  (``"\\ud800"`` parses to a Python string no tokenizer or encoder accepts).
  Run it off the event loop for large bodies (``workers.CpuPool``).
- :func:`default_max_body_bytes`: the default limit (see its docstring).
- :func:`add_cors`: CORS headers only for ``--allowed-origins`` (none by default).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.entrypoints.openai_errors import APIError, bad_request

MAX_JSON_DEPTH = 128
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_TYPE = re.compile(r"^application/(?:[\w.+-]+\+)?json$")


def default_max_body_bytes(max_model_len: int, max_num_seqs: int) -> int:
    """``--max-request-body-bytes`` default: ``max(8 MiB, 64 x max_model_len x
    max_num_seqs)``. A request can carry at most ``max_num_seqs`` prompts that run,
    each at most ``max_model_len`` tokens, and a token is rarely more than 64 bytes
    of JSON (a 4-byte character escaped as two ``\\uXXXX`` is 12); the 8 MiB floor
    leaves room for long chats and schemas on small contexts. The default model at
    max_model_len 8192 and 64 sequences gets 32 MiB."""
    return max(8 << 20, 64 * max_model_len * max_num_seqs)


def _error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


class BodyGuardMiddleware:
    """See the module docstring. Requests without a body pass through untouched."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        is_json_route: Callable[[str, str], bool] | None = None,
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.is_json_route = is_json_route or (lambda method, path: method == "POST")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.is_json_route(
            scope.get("method", ""), scope.get("path", "")
        ):  # other methods and routes: the router answers (405, 404) without a body
            await self.app(scope, receive, send)
            return
        content_type = b""
        length: bytes | None = None
        for name, value in scope.get("headers", []):
            if name == b"content-type":
                content_type = value
            elif name == b"content-length":
                length = value
        media = content_type.split(b";", 1)[0].strip().lower().decode("latin-1")
        if not _JSON_TYPE.match(media):
            shown = media or "none"
            err = APIError(
                415,
                f"unsupported Content-Type {shown!r}: this endpoint takes a JSON body; send "
                "the header 'Content-Type: application/json'",
                code="unsupported_media_type",
            )
            await _error_response(err)(scope, receive, send)
            return
        limit = self.max_body_bytes
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared < 0:
                err = bad_request("invalid Content-Length header", code="invalid_header")
                await _error_response(err)(scope, receive, send)
                return
            if declared > limit:
                await _too_large(limit, declared)(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await _too_large(limit, None)(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False
        whole = b"".join(chunks)

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _too_large(limit: int, declared: int | None) -> JSONResponse:
    size = f" ({declared} bytes)" if declared is not None else ""
    err = APIError(
        413,
        f"the request body{size} is larger than this server's limit of {limit} bytes: send "
        "fewer or shorter prompts per request (the operator sets the limit with "
        "--max-request-body-bytes)",
        code="request_too_large",
    )
    return _error_response(err, headers={"Connection": "close"})


def _json_number(text: str) -> float | int:
    """A JSON number with a fraction or exponent: an int when it is integral (JSON
    Schema counts ``2.0`` as an integer, so the strict models accept it as one)."""
    value = float(text)
    if value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


COMPLETION_EXAMPLE = '{"prompt": "Hello", "max_tokens": 16}'


CHAT_EXAMPLE = '{"model": "...", "messages": [{"role": "user", "content": "Hello"}]}'


def parse_json_body(raw: bytes, example: str = COMPLETION_EXAMPLE) -> dict[str, Any]:
    """The body as a JSON object; raises :class:`APIError` (400) as the module
    docstring says, its message showing ``example`` (a valid body for the route).
    Blocking (CPU) for large bodies."""
    try:
        data = json.loads(raw, parse_float=_json_number)
    except RecursionError:
        raise _too_deep() from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(
            f"the request body is not valid JSON ({e}): send a JSON object, for example " + example,
            code="invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise bad_request(
            f"the request body must be a JSON object, got {type(data).__name__}: for example "
            + example,
            code="invalid_json",
        )
    check_json_value(data, surrogates=_may_hold_surrogates(raw))
    return data


def _may_hold_surrogates(raw: bytes) -> bool:
    """False only when the parsed body cannot contain a lone surrogate: UTF-8 with no
    ``\\ud``/``\\uD`` escape and no 0xED byte (``json`` decodes with
    ``surrogatepass``, so raw surrogate bytes would get through). Byte searches run at
    memory speed; the per-string regex scan of a 20 MB prompt held the GIL ~0.5 s."""
    if json.detect_encoding(raw) != "utf-8":
        return True
    return b"\\ud" in raw or b"\\uD" in raw or b"\xed" in raw


def _too_deep() -> APIError:
    return bad_request(
        f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep: flatten it "
        "(no field of this API needs that depth)",
        code="invalid_json",
    )


def check_json_value(data: Any, *, surrogates: bool = True) -> None:
    """Raise APIError (400) for nesting deeper than :data:`MAX_JSON_DEPTH` or (unless
    ``surrogates`` is False: the caller knows there is none) a lone surrogate in any
    string or key; ``param`` is the path of the offending value."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if surrogates and _SURROGATE.search(value):
                raise _surrogate(path)
        elif isinstance(value, dict):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            for key, item in value.items():
                if surrogates and _SURROGATE.search(key):
                    raise _surrogate((*path, key))
                if isinstance(item, str | dict | list):
                    stack.append((item, depth + 1, (*path, key)))
        elif isinstance(value, list):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            for i, item in enumerate(value):
                if isinstance(item, str | dict | list):
                    stack.append((item, depth + 1, (*path, i)))


def _path_text(path: tuple[Any, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out or "body"


def _surrogate(path: tuple[Any, ...]) -> APIError:
    where = _path_text(path)
    return bad_request(
        f"invalid text in '{where}': it contains a lone UTF-16 surrogate (an escape such as "
        '"\\ud800" without its pair), which is not a character; send valid Unicode (a '
        'character outside the BMP is a pair such as "\\ud83d\\ude00")',
        param=where,
        code="invalid_unicode",
    )


def add_cors(app: FastAPI, allowed_origins: list[str] | None) -> None:
    """CORS for ``allowed_origins`` only (``["*"]`` for any); nothing when empty, so
    browsers keep cross-origin pages from reading any answer."""
    if not allowed_origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(allowed_origins),
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["Authorization", "Content-Type"],
        allow_credentials=False,
        max_age=600,
    )
