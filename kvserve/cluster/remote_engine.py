"""RemoteEngine: the OpenAI server's engine (``EngineClient``) over N Ray Serve replicas.

At the ingress, per request: validate (the engine's own
:func:`~kvserve.engine.validation.validate_request`, grammar compiled here with the
same tokenizer, so a bad grammar never reaches a replica's step), build the
engine ``Request``, compute its chained block hashes ONCE with the engine's code
(``extend_block_hashes``, with the replicas' fingerprint, block size, algorithm and
the request's ``cache_salt``), then call ``EngineReplica.generate`` through the Serve
handle; the custom request router (``router.py``) reads the hashes to pick the
replica, and the replica's engine reuses them instead of hashing again. A request
with ``n``/``best_of`` above 1 goes whole to that one replica, whose engine computes
the prompt once and forks the samples; their deltas come back on the one call,
tagged with ``sample_index``, and are handed to one stream per sample.

Faults: a replica that dies before it accepted the request (no ``Accepted`` yet, so
nothing was queued anywhere) is retried on another replica, at most
``max_attempts`` times within ``retry_timeout_s``. A dead replica leaves the router at
once: :meth:`RemoteEngine.watch_replicas` (every 0.5 s) hands the replicas the
metrics hub no longer lists to ``routing_state.exclude_replicas``, so no request is
sent to it (Ray's router also drops it as soon as a call to it fails). A replica that dies while streaming ends that stream
with ``RequestFailedError`` naming the replica (the server turns it into a 500 or an
error event).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any

from ray.exceptions import RayError

from kvserve.cluster.cluster_metrics import RouterMetrics, label_replicas, label_texts
from kvserve.cluster.prefix_index import block_key
from kvserve.cluster.protocol import Accepted, EngineFacts, Refused, RoutedRequest
from kvserve.engine.async_engine import (
    EngineUnavailableError,
    QueueFullError,
    RequestFailedError,
)
from kvserve.engine.outputs import RequestDelta
from kvserve.engine.validation import RequestLimits, validate_request
from kvserve.kv_cache.hashing import extend_block_hashes, request_extra_keys
from kvserve.request import Request, RequestError, SamplingParams
from kvserve.structured.compiler import GrammarCompiler

logger = logging.getLogger("kvserve.cluster")


class _ReplicaCall:
    """One accepted ``EngineReplica.generate`` call: the deltas of every sample of one
    request, tagged with their ``sample_index``, on one Ray stream.

    Whichever sample stream needs a delta that has not arrived reads the next one off
    the call (one reader at a time) and hands it to the queue of its sample, so the
    streams of a request can be iterated in any order or concurrently. Rules: a
    failure of the call (the replica died, the stream ended early, a foreign item)
    fails every sample's stream with the same :class:`RequestFailedError`; the call
    is cancelled (the replica aborts whatever is left of the request) once every
    sample has finished or been aborted and at least one was aborted."""

    def __init__(self, gen: Any, replica: str, num_samples: int) -> None:
        self._gen = gen
        self.replica = replica
        self._queues: list[collections.deque[RequestDelta]] = [
            collections.deque() for _ in range(num_samples)
        ]
        self._open = set(range(num_samples))  # no finished delta read, not aborted
        self._any_aborted = False
        self._lock = asyncio.Lock()
        self._error: RequestFailedError | None = None
        self.cancelled = False

    async def next_delta(self, index: int) -> RequestDelta:
        queue = self._queues[index]
        while not queue:
            if self._error is not None:
                raise self._error
            async with self._lock:
                if not queue and self._error is None:
                    await self._read_one()
        return queue.popleft()

    async def _read_one(self) -> None:
        try:
            item = await self._gen.__anext__()
        except StopAsyncIteration:
            self._fail(
                f"replica {self.replica} ended this request's stream before it finished; "
                "retry the request"
            )
            return
        except RayError as e:
            self._fail(
                f"replica {self.replica} failed while serving this request "
                f"({type(e).__name__}: the replica process died or became unreachable); "
                "the partial completion is lost, retry the request"
            )
            return
        if not isinstance(item, RequestDelta) or not 0 <= item.sample_index < len(self._queues):
            self._fail(f"replica {self.replica} sent {type(item).__name__}")
            return
        index = item.sample_index
        if index in self._open:  # an aborted sample's late deltas are dropped
            self._queues[index].append(item)
            if item.finished:
                self._open.discard(index)
                self._cancel_if_done()

    def _fail(self, message: str) -> None:
        self._error = RequestFailedError(message)
        self._open.clear()
        if not self.cancelled:
            self.cancelled = True
            self._gen.cancel()

    def abort(self, index: int) -> None:
        """Sample ``index``'s stream was aborted: drop its deltas; once no sample is
        left open, cancel the call."""
        self._queues[index].clear()
        if index in self._open:
            self._open.discard(index)
            self._any_aborted = True
            self._cancel_if_done()

    def _cancel_if_done(self) -> None:
        """No sample left open and one was aborted: the replica still runs it."""
        if not self._open and self._any_aborted and not self.cancelled:
            self.cancelled = True
            self._gen.cancel()


class RemoteStream:
    """The deltas of one sample of a request served by a replica (a ``DeltaStream``).
    The samples of one request share one call (:class:`_ReplicaCall`)."""

    def __init__(self, call: _ReplicaCall, sample_index: int, request_id: str) -> None:
        self._call = call
        self.sample_index = sample_index
        self.request_id = request_id
        self.replica = call.replica
        self.finished = False

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        try:
            delta = await self._call.next_delta(self.sample_index)
        except RequestFailedError:
            self.finished = True
            raise
        if delta.finished:
            self.finished = True
        return delta

    def abort(self) -> None:
        """Stop this sample: its deltas are dropped; the replica aborts the request (and
        frees its blocks) once every sample of it is finished or aborted. Idempotent."""
        if not self.finished:
            self.finished = True
            self._call.abort(self.sample_index)


class RemoteEngine:
    """See the module docstring. ``handle``: the engine deployment's handle;
    ``hub``: the metrics hub's handle; ``facts``: from a replica's ``info()``;
    ``ingress_id``: this ingress replica's name, the ``ingress`` label of its router
    series in ``/metrics`` (unique per ingress replica)."""

    def __init__(
        self,
        handle: Any,
        hub: Any,
        facts: EngineFacts,
        tokenizer: Any,
        *,
        max_attempts: int = 5,
        retry_timeout_s: float = 30.0,
        min_healthy_replicas: int = 1,
        ingress_id: str = "0",
    ) -> None:
        if facts.hash_algo != "sha256" and facts.enable_prefix_caching:
            raise ValueError(
                f"hash_algo={facts.hash_algo!r} gives different hashes in every process, so the "
                "router cannot predict the replicas' caches: use --hash-algo sha256 with --replicas"
            )
        self._handle = handle.options(stream=True)
        self._hub = hub
        self.facts = facts
        self.tokenizer = tokenizer
        self.model_name = facts.model_name
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self.max_num_seqs = facts.max_num_seqs
        self.router_metrics = RouterMetrics()
        self.ingress_id = ingress_id
        self.max_attempts = max_attempts
        self.retry_timeout_s = retry_timeout_s
        self._accepting = True
        self.min_healthy_replicas = min_healthy_replicas
        self.num_live_replicas = 0  # from the metrics hub (watch_replicas)
        self._seen_replicas: set[str] = set()  # every replica the hub ever listed
        self._hashed_with = (facts.model_fingerprint, facts.block_size, facts.hash_algo)
        self.limits = RequestLimits(facts.max_model_len, facts.vocab_size, facts.max_num_seqs)
        self.grammar_compiler = GrammarCompiler(
            tokenizer, facts.vocab_size, facts.eos_token_ids[0] if facts.eos_token_ids else None
        )

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_healthy(self) -> bool:
        """Accepting, and at least ``min_healthy_replicas`` replicas alive (the count
        :meth:`watch_replicas` keeps)."""
        return self._accepting and self.num_live_replicas >= self.min_healthy_replicas

    async def watch_replicas(self, period_s: float = 0.5) -> None:
        """Keep :attr:`num_live_replicas` current (the hub drops a dead replica's actor
        at its next snapshot); runs until cancelled."""
        while True:
            try:
                await self.snapshot_replicas()
            except asyncio.CancelledError:
                raise
            except Exception:  # the hub restarting: keep the last count a moment
                logger.warning("replica watch: the metrics hub did not answer", exc_info=True)
                self.num_live_replicas = 0
            else:
                try:  # other ingresses' /metrics show this router's series
                    await self._push_router_text()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.warning("replica watch: router series not pushed", exc_info=True)
            await asyncio.sleep(period_s)

    def start(self) -> None:
        self._accepting = True

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        self._accepting = False

    # ------------------------------------------------------------------ requests
    def make_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate as the engine does (:func:`validate_request`), build the request,
        hash its full blocks."""
        f = self.facts
        validate_request(prompt_token_ids, params, self.limits, grammar=self.grammar_compiler)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=f.max_model_len - len(prompt_token_ids))
        if request_id is None:
            raise RequestError("a request id is required", param="request_id")
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_id=f.eos_token_ids[0] if f.eos_token_ids else None,
            cache_salt=cache_salt,
            prompt=prompt,
        )
        if f.enable_prefix_caching:
            extra = request_extra_keys(f.model_fingerprint, None, cache_salt)
            extend_block_hashes(
                request.block_hashes, request.all_token_ids, f.block_size, extra, "sha256"
            )
        return request

    async def submit_samples(
        self, request: Request, *, max_waiting: int | None = None
    ) -> list[RemoteStream]:
        """Route ``request`` with every sample it asks for (``n``/``best_of``) to ONE
        replica and return one stream per sample, in sample order, once it accepted.
        That replica's engine computes the prompt once and forks the samples from it
        (``Request.with_samples``), as one engine does. The caller must drain or abort
        every stream (the replica aborts the request once all are aborted or done)."""
        return await self._route(request, max_waiting)

    async def submit(self, request: Request, *, max_waiting: int | None = None) -> RemoteStream:
        """Route and queue ``request``; return the stream of its first sample once a
        replica accepted it (the other samples, if any, are aborted: use
        :meth:`submit_samples` for them)."""
        streams = await self._route(request, max_waiting)
        for stream in streams[1:]:
            stream.abort()
        return streams[0]

    async def submit_all(
        self, requests: list[Request], *, max_waiting: int | None = None
    ) -> list[list[RemoteStream]]:
        """Queue every request or none: each replica admits its own (against its own
        queue, ``max_waiting``); if one is refused the ones already queued are
        aborted and the refusal raised."""
        out: list[list[RemoteStream]] = []
        try:
            for request in requests:
                out.append(await self.submit_samples(request, max_waiting=max_waiting))
        except BaseException:
            for streams in out:
                for stream in streams:
                    stream.abort()
            raise
        return out

    async def _route(self, request: Request, max_waiting: int | None) -> list[RemoteStream]:
        """Send ``request`` (unsplit: the replica forks its samples) to the replica the
        router picks; resend while replicas die before accepting it."""
        if not self._accepting:
            raise EngineUnavailableError("the server is shutting down; retry on another server")
        routed = RoutedRequest(
            request,
            tuple(block_key(h) for h in request.block_hashes),
            self._hashed_with,
            max_waiting,
        )
        deadline = time.monotonic() + self.retry_timeout_s
        last_error: BaseException | None = None
        for attempt in range(self.max_attempts):
            if attempt:
                self.router_metrics.count_resubmitted()
            gen = self._handle.generate.remote(routed)
            try:
                first = await gen.__anext__()
            except RayError as e:  # the replica died before accepting: nothing queued
                last_error = e
                logger.warning(
                    "request %s: replica failed before accepting (%s); resending",
                    request.req_id,
                    type(e).__name__,
                )
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
                continue
            except BaseException:
                gen.cancel()
                raise
            if isinstance(first, Refused):
                raise _refusal_error(first)
            if not isinstance(first, Accepted):
                gen.cancel()
                raise EngineUnavailableError(f"a replica answered {type(first).__name__} first")
            if routed.decision is not None:
                self.router_metrics.observe(routed.decision)
            num_samples = request.sampling_params.num_samples
            call = _ReplicaCall(gen, first.replica, num_samples)
            return [
                RemoteStream(call, i, request.req_id if i == 0 else f"{request.req_id}#{i}")
                for i in range(num_samples)
            ]
        raise EngineUnavailableError(
            f"no replica accepted the request after {self.max_attempts} attempts "
            f"(last error: {type(last_error).__name__}); retry in a few seconds"
        )

    # ------------------------------------------------------------------ metrics
    async def snapshot_replicas(self) -> dict[str, dict[str, Any]]:
        """{replica: {"pid", "age_s", "text"}} from the metrics hub."""
        from kvserve.cluster.routing_state import exclude_replicas

        snap: dict[str, dict[str, Any]] = await self._hub.snapshot.remote()
        self.router_metrics.set_num_replicas(len(snap))
        self.num_live_replicas = len(snap)
        # Listed once, not now: dead, hung (stale) or unreachable -> out of the router
        # until listed again (a replacement replica has a new name).
        self._seen_replicas.update(snap)
        gone = frozenset(self._seen_replicas.difference(snap))
        exclude_replicas(gone)
        self.router_metrics.set_num_excluded(len(gone))
        return snap

    async def _push_router_text(self) -> str:
        """This ingress's router series, brought up to date and pushed to the hub."""
        from kvserve.cluster.routing_state import chosen_counts

        self.router_metrics.sync_chosen(chosen_counts())
        text = self.router_metrics.render().decode()
        await self._hub.push_ingress.remote(self.ingress_id, text)
        return text

    async def render_metrics(self) -> bytes:
        """Every replica's series (``replica`` label, and ``role`` with pools) and every
        ingress's router series (``ingress`` label; this one's fresh, the others' as
        last pushed, <= 0.5 s old)."""
        snap = await self.snapshot_replicas()
        roles = {r: v["meta"]["role"] for r, v in snap.items() if v.get("meta", {}).get("role")}
        if roles:  # prefill/decode pools
            sizes = collections.Counter(roles.values())
            self.router_metrics.set_pool_sizes(
                {role: sizes[role] for role in ("prefill", "decode")}
            )
        own = await self._push_router_text()
        routers = {**await self._hub.ingress_texts.remote(), self.ingress_id: own}
        replicas = label_replicas({r: v["text"] for r, v in snap.items()}, roles)
        return replicas + label_texts(routers, "ingress")


def _refusal_error(refused: Refused) -> Exception:
    if refused.kind == "request":
        code = "invalid_value" if refused.code is None else str(refused.code)
        return RequestError(refused.message, param=refused.param, code=code)
    if refused.kind == "queue_full":
        return QueueFullError(refused.message)
    return EngineUnavailableError(refused.message)
