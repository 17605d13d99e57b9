"""PrefillReplica: one prefill engine of a prefill/decode pool as a Ray Serve replica.

Nobody calls it through Serve: decode replicas send it prefill work over the KV
transfer (``kv_transfer/prefill_service.py`` on a ZeroMQ ROUTER bound to a free
port), and it streams each chunk's blocks back as a ``--kv-role prefill`` worker
does. It binds 127.0.0.1 on a local cluster and the node's address on a joined one.

Every ``metrics_push_s`` seconds it pushes to the metrics hub its Prometheus text,
its facts (``role`` "prefill", ``kv_address``...) and ``peer``: its KV-transfer
address and a :class:`~kvserve.cluster.policy.ReplicaReport` (load, cached block
keys) that decode replicas read to find it and to pick it by prefix and load
(``pool_peers``). ``check_health`` raises once its engine thread died, so Ray
restarts it (the replacement binds a new port and publishes it the same way).
Rules: the constructor runs on the replica's event loop (Serve's async ``__init__``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from typing import Any

from kvserve.cluster.policy import ReplicaReport
from kvserve.cluster.pool_peers import PREFILL, build_pool_engine
from kvserve.cluster.prefix_index import block_key, pack_keys
from kvserve.kv_transfer.config import KVTransferConfig

logger = logging.getLogger("kvserve.cluster.prefill")


def kv_bind_host() -> str:
    """127.0.0.1 on a local cluster, else this node's address (other nodes reach it)."""
    from kvserve.cluster.loopback import LOCAL_CLUSTER_ENV

    if os.environ.get(LOCAL_CLUSTER_ENV) == "1":
        return "127.0.0.1"
    import ray

    return str(ray.util.get_node_ip_address())


class PrefillReplica:
    """See the module docstring. ``engine_options``: flat engine options
    (``kvserve.engine.args``); ``kv``: the pool's ``--kv-*`` options; ``hub``: a
    handle to :class:`~kvserve.cluster.metrics_hub.MetricsHub`."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        engine_options: dict[str, Any],
        threads: int,
        kv: KVTransferConfig,
        hub: Any,
        metrics_push_s: float = 0.5,
    ) -> None:
        started_at = time.time()
        t0 = time.monotonic()
        import ray
        import torch
        from ray import serve

        from kvserve.cluster.loopback import bind_serve_grpc_to_loopback
        from kvserve.engine.args import build_engine_config
        from kvserve.engine.async_engine import AsyncEngine, run_in_scratch_thread
        from kvserve.kv_transfer.prefill_connector import PrefillConnector
        from kvserve.kv_transfer.prefill_service import PrefillService

        bind_serve_grpc_to_loopback()
        torch.set_num_threads(threads)
        self.name: str = serve.get_replica_context().replica_id.unique_id
        self.epoch = uuid.uuid4().hex
        self._seq = 0
        config = build_engine_config(**engine_options)
        host = kv_bind_host()
        self.engine = run_in_scratch_thread(
            lambda: build_pool_engine(config, kv, PREFILL, host=host)
        )
        connector = self.engine.kv_connector
        assert isinstance(connector, PrefillConnector)  # what build_pool_engine builds
        self.kv_address: str = connector.transport.address  # type: ignore[attr-defined]
        self.async_engine = AsyncEngine(self.engine)
        self.async_engine.start()
        self.service = PrefillService(self.async_engine, connector, connector.transport)
        self.service.start()
        self._hub = hub
        self._actor: Any = ray.get_runtime_context().current_actor
        cost = self.engine.scheduler.cost_model
        self.meta: dict[str, Any] = {
            "role": PREFILL,
            "kv_address": self.kv_address,
            "started_at": round(started_at, 3),
            "startup_s": round(time.monotonic() - t0, 3),
            "step_fit": "off" if cost is None else cost.source,
        }
        self._push_task = asyncio.get_running_loop().create_task(self._push(metrics_push_s))
        logger.info(
            "prefill replica %s (pid %d): KV transfer on %s, %d KV blocks, ready in %.2f s",
            self.name,
            os.getpid(),
            self.kv_address,
            self.engine.kv_cache_manager.num_blocks,
            self.meta["startup_s"],
        )

    def info(self) -> dict[str, Any]:
        """This replica's facts (as ``/cluster/replicas`` lists them)."""
        return dict(self.meta)

    def report(self) -> ReplicaReport:
        """Load and cached block keys, for the decode replicas' choice."""
        stats = self.async_engine.stats()
        manager = self.engine.kv_cache_manager
        self._seq += 1
        return ReplicaReport(
            epoch=self.epoch,
            seq=self._seq,
            num_running=stats.num_requests_running,
            num_waiting=self.async_engine.num_waiting(),
            num_free_blocks=stats.num_reclaimable_blocks + stats.num_empty_blocks,
            num_blocks=manager.num_blocks - 1,
            cached_keys=pack_keys(block_key(h) for h in manager.cached_block_hashes()),
        )

    def check_health(self) -> None:
        if not self.async_engine.is_running:
            raise RuntimeError(f"prefill replica {self.name}: the engine is not running")

    async def __del__(self) -> None:
        self._push_task.cancel()
        with contextlib.suppress(Exception):
            await self.async_engine.shutdown()

    async def _push(self, period_s: float) -> None:
        while True:
            try:
                text = self.async_engine.metrics.render().decode()
                peer = {"kv_address": self.kv_address, "report": self.report().to_stats()}
                await self._hub.push.remote(
                    self.name, os.getpid(), text, self._actor, self.meta, peer
                )
            except asyncio.CancelledError:
                raise
            except Exception:  # the hub restarting must not take the replica down
                logger.warning("prefill replica %s: push failed", self.name, exc_info=True)
            await asyncio.sleep(period_s)
