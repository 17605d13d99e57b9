"""The load generator: sends a workload to an OpenAI-compatible server and times it.

Every request streams (``stream=true``, ``stream_options.include_usage``) and asks for
``ignore_eos`` so output lengths are exact where the server supports it (kvserve,
vLLM; others ignore the field). Each SSE chunk that carries a choice is timed on
arrival; a chunk with only a ``finish_reason`` and no text is not an output token.

Sessions start at their workload ``arrival_s`` or, when that is None, at times from
:func:`~kvserve.bench.workloads.arrival_times` (Poisson at ``request_rate``). A
session's turns go one after another, each prompt resending the history with the
previous answers. ``max_concurrency`` caps requests in flight (a semaphore held for
the request's whole stream). A failed turn ends its session; the turns it skipped
are recorded as failed with error "skipped: an earlier turn failed".

The server's ``/metrics`` is read before and after the run for the prefix-cache
counters; a server without one is fine.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from kvserve.bench.metrics import RequestResult, parse_prefix_cache_counters, prefix_cache_delta
from kvserve.bench.spec_metrics import parse_spec_counters, spec_delta
from kvserve.bench.workloads import Session, Workload, arrival_times, render_messages, render_prompt

Endpoint = Literal["completions", "chat"]
SKIPPED = "skipped: an earlier turn failed"


@dataclass(frozen=True)
class LoadConfig:
    """How to send a workload. ``base_url`` is the server root (``/v1`` is appended;
    a trailing ``/v1`` given by the user is accepted too)."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id from GET /v1/models
    endpoint: Endpoint = "completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    num_warmup: int = 0
    progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(
                f"invalid endpoint={self.endpoint!r}: must be 'completions' or 'chat' (for example: --endpoint chat)"
            )
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"invalid base_url={self.base_url!r}: must start with http:// or https:// "
                "(for example: --base-url http://127.0.0.1:8000)"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(
                f"invalid max_concurrency={self.max_concurrency!r}: must be >= 1 or unset "
                "(for example: --max-concurrency 16)"
            )
        if not self.request_timeout_s > 0:
            raise ValueError(
                f"invalid request_timeout_s={self.request_timeout_s!r}: must be > 0 (for example: --request-timeout 600)"
            )
        if self.num_warmup < 0:
            raise ValueError(
                f"invalid num_warmup={self.num_warmup!r}: must be >= 0 (for example: --warmup 1)"
            )
        # arrival_times validates request_rate and burstiness
        arrival_times(0, self.request_rate, self.burstiness)

    @property
    def root_url(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")


@dataclass
class BenchRun:
    """A finished run: per-request results, wall time and server counters."""

    results: list[RequestResult]
    duration_s: float
    model: str
    prefix_cache: dict[str, Any] | None
    config: LoadConfig
    spec_decode: dict[str, Any] | None = None  # kvserve.bench.spec_metrics.spec_delta

    def config_json(self) -> dict[str, Any]:
        d = asdict(self.config)
        d["request_rate"] = (
            "inf" if math.isinf(self.config.request_rate) else self.config.request_rate
        )
        d["api_key"] = "***" if self.config.api_key else None
        d["model"] = self.model
        return d


def _headers(config: LoadConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


async def _resolve_model(client: httpx.AsyncClient, config: LoadConfig) -> str:
    if config.model:
        return config.model
    resp = await client.get(f"{config.root_url}/v1/models", headers=_headers(config))
    if resp.status_code != 200:
        raise RuntimeError(
            f"GET {config.root_url}/v1/models answered {resp.status_code}: {resp.text[:200]} "
            "(pass --model NAME to skip this lookup)"
        )
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{config.root_url}/v1/models lists no model; pass --model NAME")
    return str(data[0]["id"])


async def _read_prefix_counters(
    client: httpx.AsyncClient, config: LoadConfig
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(prefix-cache counters, speculative-decoding counters) from ``/metrics``."""
    try:
        resp = await client.get(
            f"{config.root_url}/metrics", headers=_headers(config), timeout=10.0
        )
        if resp.status_code != 200:
            return None, None
        return parse_prefix_cache_counters(resp.text), parse_spec_counters(resp.text)
    except (httpx.HTTPError, ValueError):
        return None, None


def build_payload(
    config: LoadConfig, model: str, session: Session, turn: int, answers: list[str]
) -> dict[str, Any]:
    """The JSON body for turn ``turn`` of ``session`` (history from ``answers``)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": session.turns[turn].output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = render_messages(session, turn, answers)
    else:
        body["prompt"] = render_prompt(session, turn, answers)
    body.update(config.extra_body)
    return body


async def send_request(
    client: httpx.AsyncClient,
    config: LoadConfig,
    body: dict[str, Any],
    result: RequestResult,
    clock: Callable[[], float],
) -> None:
    """POST ``body`` with streaming and fill ``result`` (times from ``clock``).

    Never raises for server or network errors: they end up in ``result.error``.
    """
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    text_parts: list[str] = []
    result.send_time = clock()
    try:
        async with client.stream(
            "POST", f"{config.root_url}{path}", json=body, headers=_headers(config)
        ) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {resp.status_code}: {detail}"
                result.end_time = clock()
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = clock()
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    result.end_time = now
                    return
                if choices := chunk.get("choices"):
                    choice = choices[0]
                    if config.endpoint == "chat":
                        # the role-only first delta and the finish delta are no tokens
                        text = (choice.get("delta") or {}).get("content")
                        is_token = bool(text)
                    else:
                        text = choice.get("text")
                        is_token = bool(text) or choice.get("finish_reason") is None
                    if is_token:
                        result.chunk_times.append(now)
                        text_parts.append(text or "")
                if usage := chunk.get("usage"):
                    result.num_output_tokens = usage.get("completion_tokens")
                    result.num_prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    result.num_cached_tokens = details.get("cached_tokens")
        result.end_time = clock()
        result.generated_text = "".join(text_parts)
        if not result.chunk_times:
            result.error = "no output tokens in the stream"
        else:
            result.success = True
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.end_time = clock()
        result.error = f"{type(e).__name__}: {e}"[:300]


async def run_workload_async(workload: Workload, config: LoadConfig) -> BenchRun:
    """Send every request of ``workload`` and collect the results (see module doc)."""
    config.validate()
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = await _resolve_model(client, config)
        await _warmup(client, config, model, workload)
        before, spec_before = await _read_prefix_counters(client, config)
        results = await _run_sessions(client, config, model, workload)
        duration = max([r.end_time for r in results if not math.isnan(r.end_time)], default=0.0)
        after, spec_after = await _read_prefix_counters(client, config)
    return BenchRun(
        results,
        duration,
        model,
        prefix_cache_delta(before, after),
        config,
        spec_decode=spec_delta(spec_before, spec_after),
    )


def run_workload(workload: Workload, config: LoadConfig) -> BenchRun:
    """Synchronous :func:`run_workload_async` (must not be called from a running loop)."""
    return asyncio.run(run_workload_async(workload, config))


async def _warmup(
    client: httpx.AsyncClient, config: LoadConfig, model: str, workload: Workload
) -> None:
    """Send ``num_warmup`` short requests that share no prefix with the workload."""
    if config.num_warmup == 0:
        return
    from kvserve.bench.workloads import Turn

    for i in range(config.num_warmup):
        session = Session(-1 - i, "", 0, (Turn(f" warm up request {i} please", 5, 4),))
        result = RequestResult(session.session_id, 0, 5, 4, 0.0)
        await send_request(
            client, config, build_payload(config, model, session, 0, []), result, time.perf_counter
        )
        if not result.success:
            raise RuntimeError(f"warmup request failed: {result.error}")


async def _run_sessions(
    client: httpx.AsyncClient, config: LoadConfig, model: str, workload: Workload
) -> list[RequestResult]:
    from tqdm.auto import tqdm

    free = [s for s in workload.sessions if s.arrival_s is None]
    drawn = iter(arrival_times(len(free), config.request_rate, config.burstiness, config.seed))
    starts = [s.arrival_s if s.arrival_s is not None else next(drawn) for s in workload.sessions]
    sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = tqdm(total=workload.num_requests, desc="bench", unit="req", disable=not config.progress)
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async def one_session(session: Session, start: float) -> list[RequestResult]:
        await asyncio.sleep(max(0.0, start - clock()))
        answers: list[str] = []
        out: list[RequestResult] = []
        failed = False
        for k, turn in enumerate(session.turns):
            # system + user turns so far + the earlier answers (as the server counted them)
            prompt_len = session.system_len + sum(t.prompt_len for t in session.turns[: k + 1])
            prompt_len += sum(r.output_tokens for r in out)
            result = RequestResult(
                session.session_id, k, prompt_len, turn.output_len, clock(), tag=session.tag
            )
            out.append(result)
            if failed:
                result.error = SKIPPED
                result.end_time = result.send_time
                bar.update(1)
                continue
            body = build_payload(config, model, session, k, answers)
            if sem is None:
                await send_request(client, config, body, result, clock)
            else:
                async with sem:
                    await send_request(client, config, body, result, clock)
            answers.append(result.generated_text)
            failed = not result.success
            bar.update(1)
        return out

    try:
        per_session = await asyncio.gather(
            *(one_session(s, t) for s, t in zip(workload.sessions, starts, strict=True))
        )
    finally:
        bar.close()
    return [r for rs in per_session for r in rs]
