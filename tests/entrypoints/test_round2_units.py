"""Issue 43's small items, without a model: the API-key middleware's open routes and
``--allow-unauthenticated-metrics`` (item 3), ``--device`` (item 4), and the bad-JSON
message showing a body for the route it was sent to (item 8)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvserve.engine.device import resolve_device
from kvserve.entrypoints.chat_protocol import ChatCompletionRequest
from kvserve.entrypoints.completions_protocol import CompletionRequest
from kvserve.entrypoints.openai_errors import APIError
from kvserve.entrypoints.server_http import ApiKeyMiddleware, validate_body


def _status(app: Any, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> int:
    sent: list[dict[str, Any]] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": headers or []}
    asyncio.run(_call(app, scope, receive, send, inner))
    return int(sent[0]["status"])


async def _call(factory: Any, scope: Any, receive: Any, send: Any, inner: Any) -> None:
    await factory(inner)(scope, receive, send)


@pytest.mark.parametrize(
    "path", ["/metrics", "/docs", "/openapi.json", "/version", "/v1/models", "/x"]
)
def test_every_route_but_health_needs_the_key(path: str) -> None:
    def app(inner: Any) -> ApiKeyMiddleware:
        return ApiKeyMiddleware(inner, "k")

    assert _status(app, path) == 401
    assert _status(app, path, [(b"authorization", b"Bearer k")]) == 200
    assert _status(app, "/health") == 200


def test_metrics_open_only_with_the_flag() -> None:
    def app(inner: Any) -> ApiKeyMiddleware:
        return ApiKeyMiddleware(inner, "k", open_metrics=True)

    assert _status(app, "/metrics") == 200
    assert _status(app, "/v1/models") == 401


def test_device_auto_and_cpu() -> None:
    assert resolve_device(None) == "cpu"
    assert resolve_device("auto") == "cpu"
    assert resolve_device("CPU") == "cpu"
    with pytest.raises(ValueError, match="invalid --device"):
        resolve_device("quantum")


def test_bad_json_example_matches_the_route() -> None:
    with pytest.raises(APIError) as chat:
        validate_body(b"{bad", ChatCompletionRequest)
    assert '"messages"' in chat.value.body()["error"]["message"]
    with pytest.raises(APIError) as completion:
        validate_body(b"{bad", CompletionRequest)
    assert '"prompt"' in completion.value.body()["error"]["message"]


class _Engine:
    """Just enough of an engine client for OpenAIServing.submit: records the thread
    make_request (validation, grammar compiles) runs on, then refuses."""

    def __init__(self) -> None:
        from kvserve.model.loader import load_tokenizer

        self.tokenizer = load_tokenizer("smollm2-135m-instruct")
        self.threads: list[int] = []

    def make_request(self, *args: Any, **kwargs: Any) -> Any:
        import threading

        from kvserve.request import RequestError

        self.threads.append(threading.get_ident())
        raise RequestError("stop here", param="prompt")


def test_structured_requests_validate_off_the_event_loop() -> None:
    """Item 7: a short prompt with a constraint is validated (compiled) on a worker
    thread, never on the event loop (short prompts without one stay inline)."""
    import threading

    from kvserve.entrypoints.openai_serving import OpenAIServing
    from kvserve.request import SamplingParams
    from kvserve.structured.params import StructuredOutputsParams

    engine = _Engine()
    serving = OpenAIServing(engine, served_model_name="m")  # type: ignore[arg-type]
    constrained = SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+")
    )

    async def submit(params: SamplingParams) -> int:
        with pytest.raises(APIError):
            await serving.submit("r", [("hi", [1, 2, 3], params)], None, {})
        return threading.get_ident()

    loop_thread = asyncio.run(submit(constrained))
    assert engine.threads[-1] != loop_thread
    loop_thread = asyncio.run(submit(SamplingParams(max_tokens=4)))
    assert engine.threads[-1] == loop_thread
    serving.cpu.shutdown()
