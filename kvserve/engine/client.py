"""What the OpenAI server needs from an engine, as protocols.

:class:`~kvserve.engine.async_engine.AsyncEngine` (one engine in this process) has
all of it; so does the scale-out ingress's ``RemoteEngine`` (``kvserve.cluster``),
which routes each request to one of several engine replicas. The server
(``entrypoints/openai_server.py``, ``openai_serving.py``) only calls what is here.
Nothing here imports torch or ray.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from kvserve.engine.outputs import RequestDelta
from kvserve.request import Request, SamplingParams


class DeltaStream(Protocol):
    """The deltas of one request; the last one has ``finished`` set.

    Rules: iterate it to its end or call :meth:`abort` (idempotent), so the engine
    frees the request. A failure of the engine (or of the replica serving it) raises
    ``RequestFailedError`` or ``EngineUnavailableError`` from the iteration.
    """

    finished: bool

    def __aiter__(self) -> AsyncIterator[RequestDelta]: ...

    def abort(self) -> None: ...


class EngineClient(Protocol):
    """An engine (or a fleet of them) the OpenAI server can serve.

    ``make_request`` validates (raising ``RequestError``) without changing any
    state; ``submit`` (``submit_samples``: one stream per sample) queues a request
    built by it and returns its stream, or raises
    ``QueueFullError`` / ``EngineUnavailableError`` / ``RequestError`` before
    anything is queued. ``start`` and ``shutdown`` follow the app's lifespan.
    """

    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int

    async def render_metrics(self) -> bytes:
        """``/metrics`` in Prometheus text format."""
        ...

    @property
    def is_healthy(self) -> bool: ...

    def start(self) -> None: ...

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None: ...

    def make_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> Request: ...

    async def submit(self, request: Request, *, max_waiting: int | None = None) -> DeltaStream: ...

    async def submit_samples(
        self, request: Request, *, max_waiting: int | None = None
    ) -> Sequence[DeltaStream]:
        """Queue a request and return one stream per sample (``n``/``best_of``)."""
        ...

    async def submit_all(
        self, requests: list[Request], *, max_waiting: int | None = None
    ) -> Sequence[Sequence[DeltaStream]]:
        """Queue the requests of one HTTP request all or none (their sequences are
        admitted together, ``kvserve.engine.request_limits``); the streams of each
        request's samples, request by request."""
        ...
