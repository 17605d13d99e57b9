"""EngineReplica: one kvserve engine as a Ray Serve replica.

Each replica is its own process (a Ray actor) with its own :class:`EngineCore` (model,
KV cache, scheduler) driven by an :class:`AsyncEngine`, and ``torch`` limited to
``threads`` intra-op threads. Methods Ray Serve calls:

- ``generate(routed)``: the request's stream (``protocol``): Accepted or Refused,
  then the deltas of all its samples (``n``/``best_of``: forked here from the one
  prompt computation, as one engine does; each delta names its ``sample_index``).
  Cancelling the call (the client went away) aborts every sample in the engine,
  which frees their KV blocks.
- ``info()``: :class:`EngineFacts` for the ingress.
- ``record_routing_stats()``: a :class:`ReplicaReport` (load and every cached
  block's index key), collected by the Serve controller every
  ``request_routing_stats_period_s`` and handed to the routers.
- ``record_autoscaling_stats()``: waiting requests and KV usage for the autoscaling
  policy (``scaling_policy``), when the deployment autoscales.
- ``check_health()``: raises once the engine thread died, so Ray restarts us.

With ``kv`` (the decode pool of ``--prefill-replicas P --decode-replicas D``) the
engine has a decode connector: prompts are prefilled on the prefill replicas the hub
lists (``pool_peers``: read every ``PEER_POLL_S``, chosen by prefix and load), and
locally when none is alive or one fails (``--kv-load-failure-policy recompute``).

A background task pushes this replica's Prometheus text to the metrics hub every
``metrics_push_s`` seconds. Rules: the constructor runs on the replica's event loop
(Serve's async ``__init__``), which is also the loop the engine's streams use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from kvserve.cluster.policy import ReplicaReport, RoutingConfig
from kvserve.cluster.pool_peers import DECODE, PrefillChooser, build_pool_engine, parse_peers
from kvserve.cluster.prefix_index import block_key, pack_keys
from kvserve.cluster.protocol import Accepted, EngineFacts, Refused, RoutedRequest
from kvserve.cluster.scaling_policy import KV_USAGE, WAITING
from kvserve.engine.outputs import RequestDelta
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.request import RequestError

logger = logging.getLogger("kvserve.cluster.replica")

PEER_POLL_S = 0.5  # a decode replica reads the prefill pool from the hub this often


class EngineReplica:
    """See the module docstring. ``engine_options``: flat engine options
    (``kvserve.engine.args``); ``hub``: a handle to :class:`MetricsHub` or None;
    ``kv``: the pool's ``--kv-*`` options for a decode replica (needs ``hub``),
    ``routing``: how it picks prefill replicas."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        engine_options: dict[str, Any],
        threads: int,
        hub: Any = None,
        metrics_push_s: float = 1.0,
        kv: KVTransferConfig | None = None,
        routing: RoutingConfig | None = None,
    ) -> None:
        started_at = time.time()  # the constructor begins (the actor process is up)
        t0 = time.monotonic()
        import torch
        from ray import serve

        from kvserve.engine.args import build_engine_config
        from kvserve.engine.async_engine import AsyncEngine, run_in_scratch_thread
        from kvserve.engine.engine_core import EngineCore

        torch.set_num_threads(threads)
        context = serve.get_replica_context()
        self.name: str = context.replica_id.unique_id
        self.epoch = uuid.uuid4().hex
        self._seq = 0
        config = build_engine_config(**engine_options)
        self._chooser: PrefillChooser | None = None
        if kv is None:
            self.engine = run_in_scratch_thread(lambda: EngineCore(config))
        else:
            if hub is None:
                raise ValueError("a decode replica finds its prefill peers through the hub")
            chooser = self._chooser = PrefillChooser(routing)
            self.engine = run_in_scratch_thread(
                lambda: build_pool_engine(config, kv, DECODE, chooser=chooser)
            )
        self.async_engine = AsyncEngine(self.engine)
        self.async_engine.start()
        cache = self.engine.config.cache
        self.facts = EngineFacts(
            model_name=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.vocab_size,
            max_num_seqs=self.engine.config.scheduler.max_num_seqs,
            eos_token_ids=tuple(self.engine.eos_token_ids),
            model_fingerprint=self.engine.loaded.fingerprint,
            block_size=cache.block_size,
            hash_algo=cache.hash_algo,
            enable_prefix_caching=cache.enable_prefix_caching,
        )
        self._hashed_with = (self.facts.model_fingerprint, cache.block_size, cache.hash_algo)
        self._hub = hub
        from kvserve.cluster.loopback import bind_serve_grpc_to_loopback

        bind_serve_grpc_to_loopback()
        import ray

        self._actor: Any = ray.get_runtime_context().current_actor  # the hub pings it
        cost = self.engine.scheduler.cost_model
        # /cluster/replicas shows these: when this replica started, how long its
        # constructor took (model load, step-time fit, engine start), where its fit came
        # from ("stored <file>" = reused, "calibrated" = measured now, "off")
        self.meta: dict[str, Any] = {
            "started_at": round(started_at, 3),
            "startup_s": round(time.monotonic() - t0, 3),
            "step_fit": "off" if cost is None else cost.source,
        }
        if kv is not None:
            self.meta["role"] = DECODE
        loop = asyncio.get_running_loop()
        self._push_task = (
            loop.create_task(self._push_metrics(metrics_push_s)) if hub is not None else None
        )
        self._peer_task = loop.create_task(self._watch_prefill_pool()) if kv is not None else None
        logger.info(
            "replica %s (pid %d): %s, %d KV blocks, %d threads, ready in %.2f s, step-time fit: %s",
            self.name,
            os.getpid(),
            self.engine.model_name,
            self.engine.kv_cache_manager.num_blocks,
            threads,
            self.meta["startup_s"],
            self.meta["step_fit"],
        )

    # ------------------------------------------------------------------ requests
    def info(self) -> EngineFacts:
        return self.facts

    async def generate(
        self, routed: RoutedRequest
    ) -> AsyncIterator[Accepted | Refused | RequestDelta]:
        """Queue ``routed.request`` in this engine and stream it (module docstring)."""
        from kvserve.engine.async_engine import EngineUnavailableError, QueueFullError
        from kvserve.entrypoints.serving_streams import merge

        request = routed.request
        if routed.hashed_with != self._hashed_with:
            request.block_hashes = []  # hashed for another engine: let ours rehash
        if len(request.group) == 1:  # the ingress sends it unsplit: fork as make_request does
            request.with_samples()
        try:
            streams = await self.async_engine.submit_samples(
                request, max_waiting=routed.max_waiting
            )
        except RequestError as e:
            yield Refused("request", str(e), e.param, e.code)
            return
        except QueueFullError as e:
            yield Refused("queue_full", str(e))
            return
        except EngineUnavailableError as e:
            yield Refused("unavailable", f"replica {self.name}: {e}")
            return
        yield Accepted(self.name)
        try:
            async for _, delta in merge(streams):  # each delta carries its sample_index
                yield delta
        finally:  # cancelled (the client went away) or failed: free what is left
            for stream in streams:
                stream.abort()

    # ------------------------------------------------------------------ Serve hooks
    def record_routing_stats(self) -> dict[str, Any]:
        stats = self.async_engine.stats()
        manager = self.engine.kv_cache_manager
        self._seq += 1
        keys = pack_keys(block_key(h) for h in manager.cached_block_hashes())
        report = ReplicaReport(
            epoch=self.epoch,
            seq=self._seq,
            num_running=stats.num_requests_running,
            num_waiting=self.async_engine.num_waiting(),
            num_free_blocks=stats.num_reclaimable_blocks + stats.num_empty_blocks,
            num_blocks=manager.num_blocks - 1,
            cached_keys=keys,
        )
        return report.to_stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling metrics of this replica (``scaling_policy``): requests
        waiting in the engine, and the fraction of KV blocks requests hold (cached
        blocks no request holds are free space)."""
        stats = self.async_engine.stats()
        total = self.engine.kv_cache_manager.num_blocks - 1  # block 0 is the null block
        free = stats.num_reclaimable_blocks + stats.num_empty_blocks
        return {
            WAITING: float(self.async_engine.num_waiting()),
            KV_USAGE: max(0.0, 1.0 - free / total) if total > 0 else 0.0,
        }

    def check_health(self) -> None:
        # is_running, not is_healthy: a decode replica serves (prefilling locally)
        # while no prefill replica is up, so it must not be restarted for that
        if not self.async_engine.is_running:
            raise RuntimeError(f"replica {self.name}: the engine is not running")

    async def __del__(self) -> None:
        for task in (self._push_task, self._peer_task):
            if task is not None:
                task.cancel()
        with contextlib.suppress(Exception):
            await self.async_engine.shutdown()

    # ------------------------------------------------------------------ prefill pool
    async def _watch_prefill_pool(self) -> None:
        """Keep the decode connector's peers and the chooser's reports current."""
        from kvserve.kv_transfer.decode_connector import DecodeConnector  # torch: not at import

        connector = self.engine.kv_connector
        assert isinstance(connector, DecodeConnector) and self._chooser is not None
        while True:
            try:
                peers = parse_peers(await self._hub.prefill_peers.remote())
                connector.set_peers(self._chooser.update(peers))
            except asyncio.CancelledError:
                raise
            except Exception:  # the hub restarting: keep the last list a moment
                logger.warning("replica %s: prefill pool read failed", self.name, exc_info=True)
            await asyncio.sleep(PEER_POLL_S)

    # ------------------------------------------------------------------ metrics
    async def _push_metrics(self, period_s: float) -> None:
        while True:
            try:
                text = self.async_engine.metrics.render().decode()
                await self._hub.push.remote(self.name, os.getpid(), text, self._actor, self.meta)
            except asyncio.CancelledError:
                raise
            except Exception:  # the hub restarting must not take the replica down
                logger.warning("replica %s: metrics push failed", self.name, exc_info=True)
            await asyncio.sleep(period_s)
