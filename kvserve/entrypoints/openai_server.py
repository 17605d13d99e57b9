"""The OpenAI-compatible HTTP server: FastAPI routes over an :class:`AsyncEngine`.

Routes:
    GET  /health                 200 while the engine runs, 503 otherwise
    GET  /metrics                Prometheus text format (``kvserve.engine.metrics``)
    GET  /v1/models              the served model and resident LoRA adapters; /v1/models/{id}
    POST /v1/load_lora_adapter   load a LoRA adapter (--enable-lora; entrypoints/lora_routes.py)
    POST /v1/unload_lora_adapter unload one (waits for its running requests)
    POST /v1/completions         stream and non-stream (``openai_serving``)
    POST /v1/chat/completions    stream and non-stream; tools (``chat/tools.py``)
    POST /v1/responses           OpenAI's Responses API (``responses``)
    GET  /docs                   Swagger UI, assets from the swagger-ui-bundle package
    POST /tokenize, /detokenize  vLLM's shapes
    GET  /openapi.json           every route's request body and responses (``openapi_doc``)

Rules this module keeps:
- Every error a client can cause is answered in OpenAI's shape
  ``{"error": {"message", "type", "param", "code"}}``: 400 bad values, types or JSON;
  401 wrong or missing API key (``/v1/*``, ``/tokenize``, ``/detokenize`` when a key
  is configured; ``/health`` and ``/metrics`` stay open, as in vLLM); 404 unknown
  model or route; 429 + ``Retry-After`` when a request's sequences do not fit the
  queue (``max_queue_len``); 503 + ``Retry-After`` while shutting down; 413 for a
  body over ``max_request_body_bytes`` and 415 for a body that is not JSON
  (``http_guard``, before the body is read).
- Nothing CPU-heavy runs on the event loop: JSON parsing, tokenization, chat
  rendering (in worker processes, ``chat.render_pool``) and detokenization run on
  worker threads (``workers.CpuPool``).
- Chat templates are the operator's (``chat_template``; a request's own only with
  ``trust_request_chat_template``); message text never forges control tokens
  (``chat.prompt``). CORS headers only for ``allowed_origins``.
- A client that disconnects (mid-stream or while waiting for a non-streamed answer)
  has its requests aborted in the engine at once, which frees their KV blocks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.client import EngineClient
from kvserve.engine.metrics import CONTENT_TYPE
from kvserve.engine.request_limits import DEFAULT_MAX_PROMPTS_PER_REQUEST
from kvserve.entrypoints.chat.prompt import ChatPromptBuilder
from kvserve.entrypoints.chat.render_pool import DEFAULT_TIMEOUT_S, RenderPool
from kvserve.entrypoints.chat_protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.entrypoints.completions_protocol import CompletionRequest
from kvserve.entrypoints.extras import (
    alias_metrics,
    asset,
    docs_html,
    ignored_fields,
    ignored_header,
    model_card,
)
from kvserve.entrypoints.http_guard import (
    BodyGuardMiddleware,
    add_cors,
    default_max_body_bytes,
)
from kvserve.entrypoints.lora_routes import add_lora_routes, lora_cards
from kvserve.entrypoints.openai_errors import APIError, bad_request
from kvserve.entrypoints.openai_serving import OpenAIServing
from kvserve.entrypoints.openapi_doc import openapi_document
from kvserve.entrypoints.responses import start_response
from kvserve.entrypoints.responses_protocol import ResponsesRequest
from kvserve.entrypoints.server_http import (
    ApiKeyMiddleware,
    SSEResponse,
    parse_body,
    respond,
    until_disconnect,
)
from kvserve.entrypoints.serving_chat import render_chat, start_chat
from kvserve.entrypoints.serving_completions import start_completion
from kvserve.entrypoints.workers import CpuPool

logger = logging.getLogger(__name__)


def build_app(
    async_engine: EngineClient,
    *,
    api_key: str | None = None,
    open_metrics: bool = False,
    served_model_name: str | None = None,
    max_queue_len: int | None = None,
    max_prompts_per_request: int | None = DEFAULT_MAX_PROMPTS_PER_REQUEST,
    tool_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    default_seed: int | None = None,
    metrics_prefix: str | None = "vllm:",
    sampling_defaults: dict[str, Any] | None = None,
    max_logprobs: int = 20,
    log_requests: bool = False,
    chat_template: str | None = None,
    trust_request_chat_template: bool = False,
    chat_template_timeout_s: float = DEFAULT_TIMEOUT_S,
    max_request_body_bytes: int | None = None,
    allowed_origins: list[str] | None = None,
) -> FastAPI:
    """The FastAPI app serving ``async_engine`` (an ``AsyncEngine``, or the scale-out
    ingress's ``RemoteEngine``: anything with :class:`~kvserve.engine.client.EngineClient`).

    Function calling, ``--seed``, generation-config defaults, ``--max-logprobs``
    and request logging are :class:`OpenAIServing`'s options of the same names;
    ``metrics_prefix``: /metrics repeats every ``kvserve:`` series under it (None: not).

    ``served_model_name`` (default: the engine's model name) is the one name
    ``model`` may take. ``max_queue_len``: a request whose sequences (prompts x n)
    do not fit beside the running ones and this many waiting ones gets 429 with
    Retry-After (None: no limit); ``max_prompts_per_request``: more prompts in one
    request is a 400 (None: no limit); see ``kvserve.engine.request_limits``. The engine thread starts with the
    app's lifespan (or at the first request); lifespan shutdown stops it.

    ``chat_template``: the template text (``chat.template.load_chat_template`` reads
    ``--chat-template``; None: the tokenizer's own). ``trust_request_chat_template``
    lets requests bring their own. ``chat_template_timeout_s`` bounds one render.
    ``max_request_body_bytes`` (None: ``http_guard.default_max_body_bytes``) answers
    413 past it. ``allowed_origins``: CORS origins (None: no CORS headers).
    """
    if max_queue_len is not None and (not isinstance(max_queue_len, int) or max_queue_len < 0):
        raise ValueError(
            f"invalid max_queue_len={max_queue_len!r}: use an integer >= 0 or None for no "
            "limit (for example: max_queue_len=64)"
        )
    served = served_model_name or async_engine.model_name
    max_len = async_engine.max_model_len
    render_pool = RenderPool(num_workers=2, timeout_s=chat_template_timeout_s)
    chat = ChatPromptBuilder(
        async_engine.tokenizer,
        template=chat_template,
        render=render_pool.render,
        trust_request_template=trust_request_chat_template,
        max_chars=max(1 << 20, 64 * max_len),
    )
    # Chat builds wait on render workers (at most 2 at a time; the rest queue in
    # RenderPool): their own threads, so a slow template never holds up tokenization.
    cpu = CpuPool(4, "kvserve-cpu")
    chat_threads = CpuPool(4, "kvserve-chat")
    serving = OpenAIServing(
        async_engine,
        served_model_name=served,
        max_queue_len=max_queue_len,
        max_prompts_per_request=max_prompts_per_request,
        tool_parser=tool_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        default_seed=default_seed,
        sampling_defaults=sampling_defaults,
        max_logprobs=max_logprobs,
        log_requests=log_requests,
        chat=chat,
        cpu=cpu,
        chat_threads=chat_threads,
    )
    started = time.time()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        await cpu.run(render_pool.warm)
        auto_tools = bool(tool_parser and enable_auto_tool_choice and chat.template)
        if auto_tools and not await cpu.run(chat.renders_tools):
            logger.warning(
                "--tool-call-parser %s is set but the chat template has no tools section: "
                'requests with tools and tool_choice "auto" are refused (400) because the '
                "model would never see the tools; start with --chat-template FILE naming "
                "a template that renders tools (docs/function-calling.md)",
                tool_parser,
            )
        compiler = getattr(async_engine, "grammar_compiler", None) or getattr(
            getattr(async_engine, "engine", None), "grammar_compiler", None
        )
        if compiler is not None:  # ready means the first grammar compiles at full speed
            await cpu.run(compiler.warm)
        try:
            yield
        finally:
            await async_engine.shutdown()
            if compiler is not None and hasattr(compiler, "close"):
                compiler.close()
            render_pool.close()
            cpu.shutdown()
            chat_threads.shutdown()

    app = FastAPI(title="kvserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine = async_engine
    app.state.serving = serving
    app.state.render_pool = render_pool

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(
                vocab_size=async_engine.vocab_size,
                max_model_len=max_len,
                max_num_seqs=async_engine.max_num_seqs,
                api_key_required=bool(api_key),
                trust_request_chat_template=trust_request_chat_template,
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    # Outermost last: CORS, then the API key, then the body guard (so a request
    # without the key is refused before its body is read).
    body_limit = max_request_body_bytes or default_max_body_bytes(
        max_len, async_engine.max_num_seqs
    )
    post_paths: set[str] = set()

    def is_json_route(method: str, path: str) -> bool:
        if not post_paths:  # every POST route takes JSON (read once routes exist)
            post_paths.update(
                str(getattr(r, "path", ""))
                for r in app.routes
                if "POST" in getattr(r, "methods", ())
            )
        return method == "POST" and path in post_paths

    app.add_middleware(BodyGuardMiddleware, max_body_bytes=body_limit, is_json_route=is_json_route)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_metrics=open_metrics)
    add_cors(app, allowed_origins)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = (
                f"no route {request.method} {request.url.path}: this server has "
                "/v1/models, /v1/completions, /v1/chat/completions, /v1/responses, "
                "/tokenize, /detokenize, /health, /metrics, /version, /docs and /openapi.json"
            )
        else:
            message = f"{exc.detail} ({request.method} {request.url.path})"
        err = APIError(exc.status_code, message, code=exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        err = APIError(500, f"internal server error: {exc}", type="server_error", code=500)
        return JSONResponse(err.body(), status_code=500)

    # ------------------------------------------------------------------ plain routes
    @app.get("/health")
    async def health() -> Response:
        if async_engine.is_healthy:
            return Response(status_code=200)
        err = APIError(
            503,
            "the engine is not ready: starting, shutting down, stopped, or (decode role) "
            "waiting for its first prefill peer to answer",
            type="server_error",
            code=503,
        )
        return JSONResponse(err.body(), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = alias_metrics(await async_engine.render_metrics(), metrics_prefix)
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> Response:
        base = request.scope.get("root_path", "")
        return Response(
            docs_html(f"{base}/openapi.json", f"{base}/docs/assets"), media_type="text/html"
        )

    @app.get("/docs/assets/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> Response:
        found = asset(name)
        if found is None:
            raise StarletteHTTPException(404)
        return Response(found[0], media_type=found[1])

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as pkg_version

        try:
            return {"version": pkg_version("kvserve")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    def card() -> dict[str, Any]:
        return model_card(served, async_engine.model_name, int(started), async_engine.max_model_len)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        loras = lora_cards(serving, int(started), async_engine.max_model_len)
        return {"object": "list", "data": [card(), *loras]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if serving.check_model(model_id) is not None:
            loras = lora_cards(serving, int(started), async_engine.max_model_len)
            return next(c for c in loras if c["id"] == model_id)
        return card()

    add_lora_routes(app, serving)

    # ------------------------------------------------------------------ generation
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest, cpu)
        gen = await start_completion(serving, req)
        return await respond(request, serving, gen, req.stream, ignored_fields(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest, cpu)
        gen = await start_chat(serving, req)
        return await respond(request, serving, gen, req.stream, ignored_fields(req))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req = await parse_body(request, ResponsesRequest, cpu)
        run = await start_response(serving, req)
        headers = ignored_header(ignored_fields(req))
        if req.stream:
            return SSEResponse(run.events(), on_close=run.abort, headers=headers)
        body = await until_disconnect(request, run.collect(), on_disconnect=run.abort)
        if body is None:
            return Response(status_code=499)
        return JSONResponse(body, headers=headers)

    # ------------------------------------------------------------------ tokenizer
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, TokenizeRequest, cpu)
        serving.check_model(req.model)
        tok = async_engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise bad_request(
                'send exactly one of "prompt" (a string) or "messages" (a chat); for example '
                '{"prompt": "Hello"}',
                param="prompt",
            )
        if req.messages is not None and not req.messages:
            raise bad_request(
                "messages is empty: send at least one message; for example "
                '{"messages": [{"role": "user", "content": "Hello"}]}',
                param="messages",
            )
        if req.prompt is not None:
            # As /v1/completions sees a prompt: special-token strings are special tokens.
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await cpu.run_unless_small(
                len(req.prompt),
                lambda: list(tok.encode(req.prompt, add_special_tokens=add_special)),
            )
        else:
            prompt = await render_chat(
                serving,
                [m.as_template_dict() for m in req.messages or []],
                add_generation_prompt=req.add_generation_prompt,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
            )
            ids = prompt.token_ids
            if req.add_special_tokens:  # BOS/EOS around the ids, never a re-tokenization
                build = getattr(tok, "build_inputs_with_special_tokens", None)
                ids = list(build(ids)) if build is not None else ids
        token_strs = (
            await cpu.run_unless_small(len(ids), tok.convert_ids_to_tokens, ids)
            if req.return_token_strs
            else None
        )
        return {
            "count": len(ids),
            "max_model_len": async_engine.max_model_len,
            "tokens": ids,
            "token_strs": token_strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, DetokenizeRequest, cpu)
        serving.check_model(req.model)
        vocab = async_engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is out of range: token ids must be integers in [0, {vocab}); "
                'for example "tokens": [1, 2, 3]',
                param="tokens",
            )
        tokens = req.tokens
        text = await cpu.run_unless_small(len(tokens), async_engine.tokenizer.decode, tokens)
        return {"prompt": text}

    return app
