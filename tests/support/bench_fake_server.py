"""A fake OpenAI-compatible streaming server: a test double for the HTTP protocol only.

It generates no text worth reading: each request streams ``max_tokens`` chunks
" t0", " t1", ... (one token each, ``delay_ms`` apart), then a finish chunk, a usage
chunk and ``data: [DONE]``. Prompt tokens are counted as whitespace-separated words.
Its ``/metrics`` exposes kvserve's prefix-cache counters: every request adds its
prompt length to the queries and, to the hits, the number of leading words it
shares with the longest-matching earlier prompt (the same figure goes into
``usage.prompt_tokens_details.cached_tokens``). A prompt containing "FAIL" gets a
400. Used in-process (:func:`start_in_thread`) or as a subprocess
(``python tests/support/bench_fake_server.py --port P``; unknown engine flags are ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvserve.bench.process import free_port


@dataclass
class FakeState:
    model: str = "fake-model"
    delay_ms: float = 1.0
    api_key: str | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    prompts: list[list[str]] = field(default_factory=list)
    queries: int = 0
    hits: int = 0
    in_flight: int = 0
    max_in_flight: int = 0


def _shared_prefix(words: list[str], earlier: list[list[str]]) -> int:
    best = 0
    for prev in earlier:
        n = 0
        for a, b in zip(words, prev, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    def unauthorized(request: Request) -> bool:
        return (
            state.api_key is not None
            and request.headers.get("authorization") != f"Bearer {state.api_key}"
        )

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = (
            "# HELP kvserve:prefix_cache_queries Prefix cache queries in tokens.\n"
            "# TYPE kvserve:prefix_cache_queries counter\n"
            f'kvserve:prefix_cache_queries_total{{model_name="{state.model}"}} {float(state.queries)}\n'
            "# HELP kvserve:prefix_cache_hits Prefix cache hits in tokens.\n"
            "# TYPE kvserve:prefix_cache_hits counter\n"
            f'kvserve:prefix_cache_hits_total{{model_name="{state.model}"}} {float(state.hits)}\n'
        )
        return PlainTextResponse(text)

    async def handle(request: Request, chat: bool) -> Any:
        if unauthorized(request):
            return JSONResponse(
                {"error": {"message": "bad key", "type": "auth", "code": 401}}, status_code=401
            )
        body = await request.json()
        state.bodies.append(body)
        if chat:
            prompt = " ".join(m["content"] for m in body["messages"])
        else:
            prompt = body["prompt"]
        if "FAIL" in prompt:
            return JSONResponse(
                {"error": {"message": "asked to fail", "type": "invalid", "code": 400}}, 400
            )
        words = prompt.split()
        cached = _shared_prefix(words, state.prompts)
        state.prompts.append(words)
        state.queries += len(words)
        state.hits += cached
        n = int(body["max_tokens"])
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, finish: str | None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            return "data: " + json.dumps({"id": "x", "object": obj, "choices": [choice]}) + "\n\n"

        async def stream() -> Any:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                async for part in tokens():
                    yield part
            finally:
                state.in_flight -= 1

        async def tokens() -> Any:
            if chat:
                role = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None,
                }
                yield "data: " + json.dumps({"id": "x", "object": obj, "choices": [role]}) + "\n\n"
            for i in range(n):
                await asyncio.sleep(state.delay_ms / 1000)
                yield chunk(f" t{i}", None)
            yield chunk("", "length")
            usage = {
                "prompt_tokens": len(words),
                "completion_tokens": n,
                "total_tokens": len(words) + n,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            yield (
                "data: "
                + json.dumps({"id": "x", "object": obj, "choices": [], "usage": usage})
                + "\n\n"
            )
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


class ThreadServer:
    """uvicorn in a daemon thread; ``stop()`` asks it to exit and joins."""

    def __init__(self, state: FakeState) -> None:
        self.state = state
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            make_app(state), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def start_in_thread(state: FakeState | None = None) -> ThreadServer:
    return ThreadServer(state or FakeState()).start()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--delay-ms", type=float, default=1.0)
    parser.add_argument(
        "--exit-at-once", action="store_true", help="exit with code 3 before serving"
    )
    args, _engine_args = parser.parse_known_args()
    if args.exit_at_once:
        raise SystemExit(3)
    state = FakeState(model=args.model, delay_ms=args.delay_ms)
    uvicorn.run(make_app(state), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
