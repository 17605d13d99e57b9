"""MetricsHub: the latest Prometheus text of every engine replica, for ``/metrics``,
and the list of live replicas for ``/cluster/replicas`` and the ingress's ``/health``.

Each replica pushes its own text every ``metrics_push_s`` seconds (``push``, with its
actor handle); the ingress reads them all (``snapshot``). A replica is left out as
soon as its actor is dead — each snapshot pings every replica's actor
(``__ray_ready__``, answered by Ray itself), and a dead actor fails that call at
once — or when it stopped pushing for ``stale_after_s`` seconds (hung, scaled away).
Each ingress replica pushes its router's text the same way (``push_ingress``, every
replica watch, 0.5 s), so ``/metrics`` on any ingress shows every ingress's routing
series (``ingress_texts``). Runs as a Serve deployment of one replica; it holds
nothing that cannot be rebuilt by the next push.

It is also the directory of a prefill/decode pool: prefill replicas push a ``peer``
entry (their KV-transfer address and routing report) and decode replicas read the
live ones with ``prefill_peers`` (``pool_peers``), so no address is typed by hand.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger("kvserve.cluster")

PING_TIMEOUT_S = 2.0


class MetricsHub:
    def __init__(self, stale_after_s: float = 10.0) -> None:
        from kvserve.cluster.loopback import bind_serve_grpc_to_loopback

        bind_serve_grpc_to_loopback()
        self.stale_after_s = stale_after_s
        self._latest: dict[str, tuple[int, float, str]] = {}
        self._actors: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._peers: dict[str, dict[str, Any]] = {}
        self._dead: set[str] = set()
        self._ingress: dict[str, tuple[float, str]] = {}

    def push(
        self,
        replica: str,
        pid: int,
        text: str,
        actor: Any = None,
        meta: dict[str, Any] | None = None,
        peer: dict[str, Any] | None = None,
    ) -> None:
        """``meta``: plain facts of the replica for ``/cluster/replicas`` (its start
        time, constructor time, step-time fit source), kept until the next push.
        ``peer``: a prefill replica's ``{"kv_address", "report"}``."""
        if replica in self._dead:
            return  # a push that was in flight when its actor died
        self._latest[replica] = (pid, time.monotonic(), text)
        if actor is not None:
            self._actors[replica] = actor
        if meta is not None:
            self._meta[replica] = dict(meta)
        if peer is not None:
            self._peers[replica] = dict(peer)

    def prefill_peers(self) -> dict[str, dict[str, Any]]:
        """{replica: {"kv_address", "report"}} of every prefill replica heard from
        within ``stale_after_s`` and not found dead (by a snapshot's ping)."""
        now = time.monotonic()
        return {
            r: peer
            for r, peer in self._peers.items()
            if r in self._latest and now - self._latest[r][1] <= self.stale_after_s
        }

    def push_ingress(self, ingress: str, text: str) -> None:
        """The latest router text of one ingress replica (kept ``stale_after_s``)."""
        self._ingress[ingress] = (time.monotonic(), text)

    def ingress_texts(self) -> dict[str, str]:
        """{ingress: router text} of every ingress heard from in ``stale_after_s``."""
        now = time.monotonic()
        for name in [n for n, (t, _) in self._ingress.items() if now - t > self.stale_after_s]:
            del self._ingress[name]
        return {name: text for name, (_, text) in self._ingress.items()}

    async def snapshot(self) -> dict[str, dict[str, Any]]:
        """{replica: {"pid", "age_s", "text", "meta"}} for every live replica heard from
        lately."""
        now = time.monotonic()
        for replica in [r for r, (_, t, _) in self._latest.items() if now - t > self.stale_after_s]:
            self._forget(replica)
        names = list(self._latest)
        states = await asyncio.gather(*(self._alive(r) for r in names))
        for replica, state in zip(names, states, strict=True):
            if state is False:
                self._forget(replica)
                self._dead.add(replica)
        unknown = {r for r, state in zip(names, states, strict=True) if state is None}
        return {
            r: {"pid": pid, "age_s": now - t, "text": text, "meta": self._meta.get(r, {})}
            for r, (pid, t, text) in self._latest.items()
            if r not in unknown
        }

    async def _alive(self, replica: str) -> bool | None:
        """True: answered (or busy: staleness decides); False: its actor is dead;
        None: the ping failed otherwise (left out of this snapshot only)."""
        actor = self._actors.get(replica)
        if actor is None:
            return True  # no handle (an older replica): staleness alone decides
        from ray.exceptions import RayActorError

        try:
            await asyncio.wait_for(actor.__ray_ready__.remote(), PING_TIMEOUT_S)
        except RayActorError:
            return False
        except TimeoutError:  # busy, not dead: staleness decides
            return True
        except Exception:
            logger.warning("replica %s: liveness ping failed", replica, exc_info=True)
            return None
        return True

    def _forget(self, replica: str) -> None:
        self._latest.pop(replica, None)
        self._actors.pop(replica, None)
        self._meta.pop(replica, None)
        self._peers.pop(replica, None)
