"""How the replicas of prefill/decode pools find and pick each other (no ray here).

    prefill replica ── push(peer={"kv_address", "report"}) ──▶ MetricsHub
    decode replica  ◀─ prefill_peers() every 0.5 s ──────────  MetricsHub
        │ update(): the reports go into a RoutingLogic (prefix index + loads),
        │ the addresses into the decode connector's peer list (set_peers)
        ▼
    DecodeConnector.update_state_after_alloc ─▶ PrefillChooser.choose(request, alive)

A prefill replica's report is the same :class:`~kvserve.cluster.policy.ReplicaReport`
an engine replica gives the ingress's router: its load and the block keys its prefix
cache holds. So a decode replica sends a prompt to the prefill replica that probably
holds the longest prefix of it, unless that one's queue outweighs the blocks saved
(the ingress's own rule, ``policy.py``), and records the choice as pending there.

:func:`build_pool_engine` builds the engine of a pool replica: the role's connector
over TCP (prefill: a ROUTER on a free port; decode: DEALERs to whatever peers the hub
lists).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvserve.cluster.policy import ReplicaReport, RoutingConfig, RoutingLogic
from kvserve.cluster.prefix_index import block_key
from kvserve.config import EngineConfig
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.request import Request

if TYPE_CHECKING:
    from kvserve.engine.engine_core import EngineCore

PREFILL = "prefill"
DECODE = "decode"


@dataclasses.dataclass(frozen=True)
class PrefillPeer:
    """One live prefill replica as the hub lists it: where its KV transfer listens,
    and its latest routing report (None before its first)."""

    replica: str
    kv_address: str
    report: ReplicaReport | None


def parse_peers(raw: Mapping[str, Mapping[str, Any]]) -> list[PrefillPeer]:
    """The hub's ``prefill_peers()`` answer as :class:`PrefillPeer` s (sorted by name);
    entries without an address are left out."""
    out = []
    for replica, entry in sorted(raw.items()):
        address = entry.get("kv_address")
        if isinstance(address, str) and address:
            out.append(PrefillPeer(replica, address, ReplicaReport.from_stats(entry.get("report"))))
    return out


class PrefillChooser:
    """A decode connector's ``peer_chooser``: a :class:`RoutingLogic` over the prefill
    replicas. Thread-safe (``update`` runs on the replica's event loop, ``choose`` and
    ``finished`` on its engine thread)."""

    def __init__(self, routing: RoutingConfig | None = None) -> None:
        self.logic = RoutingLogic(routing or RoutingConfig())
        self._lock = threading.Lock()
        self._replica_of: dict[str, str] = {}  # kv address -> replica name
        self._address_of: dict[str, str] = {}

    def update(self, peers: list[PrefillPeer]) -> list[str]:
        """Take the hub's latest list; returns the addresses (for ``set_peers``)."""
        with self._lock:
            for peer in peers:
                self.logic.observe_report(peer.replica, peer.report)
            self.logic.retain([p.replica for p in peers])
            self._replica_of = {p.kv_address: p.replica for p in peers}
            self._address_of = {p.replica: p.kv_address for p in peers}
            return [p.kv_address for p in peers]

    def choose(self, request: Request, alive: list[str]) -> str:
        with self._lock:
            names = [self._replica_of[a] for a in alive if a in self._replica_of]
            if not names:  # alive, but no longer listed by the hub: any of them
                return alive[0]
            keys = [block_key(h) for h in request.block_hashes]
            decision = self.logic.choose(
                names, keys, request_id=request.req_id, num_blocks_needed=len(keys) + 1
            )
            return self._address_of[decision.replica]

    def finished(self, req_id: str) -> None:
        with self._lock:
            self.logic.request_finished(req_id)


def build_pool_engine(
    config: EngineConfig,
    kv: KVTransferConfig,
    role: str,
    *,
    host: str = "127.0.0.1",
    chooser: PrefillChooser | None = None,
) -> EngineCore:
    """The engine of a pool replica of ``role`` (``PREFILL``: its connector's transport
    binds a free port on ``host``, ``engine.kv_connector.transport.address``;
    ``DECODE``: no peer yet, ``set_peers`` adds them). ``kv``: the pool's
    ``--kv-*`` options (role and addresses are this function's). ValueError for a
    hash algorithm other than sha256 (hashes are compared across processes)."""
    from kvserve.engine.engine_core import EngineCore
    from kvserve.kv_transfer.decode_connector import DecodeConnector
    from kvserve.kv_transfer.prefill_connector import PrefillConnector
    from kvserve.kv_transfer.tcp import DealerTransport, RouterTransport
    from kvserve.model.kernels.kv8 import resolve_kv_cache_dtype
    from kvserve.model.loader import load_model

    if config.cache.hash_algo != "sha256":
        raise ValueError(
            f"hash_algo={config.cache.hash_algo!r}: prefill and decode replicas compare block "
            "hashes across processes, which needs --hash-algo sha256"
        )
    if role not in (PREFILL, DECODE):
        raise ValueError(f"invalid pool role {role!r}: must be {PREFILL} or {DECODE}")
    m = config.model
    loaded = load_model(m.model, dtype=m.dtype, device=m.device, quantization=m.quantization)
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, loaded.dtype).name
    bs = config.cache.block_size
    connector: Any
    if role == PREFILL:
        transport = RouterTransport(host, 0)
        rkv = dataclasses.replace(kv, kv_role="prefill", kv_address=transport.address)
        connector = PrefillConnector(rkv, transport, block_size=bs)
    else:
        rkv = dataclasses.replace(kv, kv_role="decode", kv_prefill_peers=())
        connector = DecodeConnector(
            rkv, DealerTransport([]), block_size=bs, kv_dtype=kv_dtype, peer_chooser=chooser
        )
    return EngineCore(config, loaded=loaded, kv_connector=connector)
