"""The routing policies, as plain logic over replica names (no ray here).

    prefix-aware   score(r) = matched(r) / n  -  queue_weight * queue_len(r)
                              -  kv_weight * max(0, n_needed - free_blocks(r)) / n
                   n = the request's full blocks; matched(r) = its leading blocks that
                   r probably holds (PrefixIndex); the highest score wins, ties go to
                   the shorter queue, then to the replica caching fewer blocks (new
                   prefixes spread the cache footprint evenly), then to the replica
                   the leading block hashes to (rendezvous hashing: routers in
                   different ingresses that see the same reports pick the same
                   replica for a new prefix); requests without a full block rotate.
                   With ``routers`` > 1 (several ingresses) a new prefix (no replica
                   known to hold any of it) skips the load and footprint tie-breaks,
                   which differ between routers: it goes to the first replica in
                   rendezvous order whose queue stays within a bound of the mean
                   (consistent hashing with bounded loads: queue + seqs <=
                   ceil(1.25 * (total queue + seqs) / replicas), and its free KV
                   blocks fit the request), so routers agree unless loads are skewed.
    round-robin    each replica in turn.
    least-loaded   the shortest queue; ties round robin.

Balance is decided per request: a popular prefix stays on the replica that holds
it until that replica's queue outweighs the blocks it would save, then the next
request computes it on another replica, which then holds it too. There is no
fleet-wide "imbalanced, stop using affinity" switch.

``queue_len(r)`` is the larger of the sequences this router has in flight on ``r``
(exact, updated at once; a request of ``n``/``best_of`` samples counts as that
many) and the running + waiting sequences ``r`` last reported (covers other
routers' traffic). ``free_blocks(r)`` comes from the same report.

Rules a caller must keep: one thread calls a :class:`RoutingLogic` (the router's
loop); every :meth:`RoutingLogic.choose` with a ``request_id`` is matched by one
:meth:`RoutingLogic.request_finished` when that request ends.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kvserve.cluster.prefix_index import PrefixIndex, unpack_keys

Policy = Literal["prefix-aware", "round-robin", "least-loaded"]
POLICIES: tuple[str, ...] = get_args(Policy)

# Decision reasons (the ``reason`` label of kvserve:router_decisions_total).
PREFIX_HIT = "prefix_hit"  # the replica holding the longest prefix won
LOAD_OVER_PREFIX = "load_over_prefix"  # another replica held more, but its load outweighed it
NO_PREFIX = "no_prefix"  # no replica held any block of the request: the least loaded
ROUND_ROBIN = "round_robin"
LEAST_LOADED = "least_loaded"
REASONS: tuple[str, ...] = (PREFIX_HIT, LOAD_OVER_PREFIX, NO_PREFIX, ROUND_ROBIN, LEAST_LOADED)


@dataclass(frozen=True)
class RoutingConfig:
    """``queue_weight``: score lost per queued request (a full prefix match scores
    ~1). ``kv_weight``: score lost per block of the request that would not fit in the
    replica's free KV blocks, over the request's blocks. ``pending_ttl_s``: see
    :class:`PrefixIndex`. ``routers``: how many routers (one per ingress replica)
    route to the same replicas; above 1, new prefixes go by bounded-load rendezvous
    hashing (module docstring). ValueError names a bad field."""

    policy: Policy = "prefix-aware"
    queue_weight: float = 0.1
    kv_weight: float = 1.0
    pending_ttl_s: float = 5.0
    routers: int = 1

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"invalid routing policy {self.policy!r}: must be one of {', '.join(POLICIES)} "
                "(for example: --routing prefix-aware)"
            )
        for name in ("queue_weight", "kv_weight", "pending_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"invalid {name}={value!r}: must be a number >= 0")
        if isinstance(self.routers, bool) or not isinstance(self.routers, int) or self.routers < 1:
            raise ValueError(f"invalid routers={self.routers!r}: must be an integer >= 1")


@dataclass(frozen=True)
class ReplicaReport:
    """What a replica reports (its ``record_routing_stats``): plain values only.

    ``cached_keys`` is :func:`~kvserve.cluster.prefix_index.pack_keys` of every block
    its prefix cache holds; ``epoch`` names the process, ``seq`` orders reports."""

    epoch: str
    seq: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    cached_keys: bytes = b""

    def to_stats(self) -> dict[str, Any]:
        return {
            "kvserve": {
                "epoch": self.epoch,
                "seq": self.seq,
                "num_running": self.num_running,
                "num_waiting": self.num_waiting,
                "num_free_blocks": self.num_free_blocks,
                "num_blocks": self.num_blocks,
                "cached_keys": self.cached_keys,
            }
        }

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> ReplicaReport | None:
        """The report inside a routing-stats dict; None when there is none yet."""
        raw = (stats or {}).get("kvserve")
        if not isinstance(raw, dict):
            return None
        return cls(**raw)


@dataclass(frozen=True)
class Decision:
    """One routing decision. ``ranked``: every candidate, best first (the router
    offers them in that order). ``matched_blocks``: leading blocks the chosen replica
    probably holds, of the request's ``num_blocks`` full blocks."""

    replica: str
    policy: str
    reason: str
    matched_blocks: int
    num_blocks: int
    ranked: tuple[str, ...]
    scores: dict[str, float] = field(default_factory=dict)

    @property
    def matched_fraction(self) -> float:
        return self.matched_blocks / self.num_blocks if self.num_blocks else 0.0


def _rendezvous(candidates: Sequence[str], key: bytes) -> list[str]:
    """``candidates`` by highest random weight for ``key`` (rendezvous hashing): the
    same order in every process, and removing one replica moves only its keys."""
    return sorted(
        candidates,
        key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest(),
        reverse=True,
    )


class RoutingLogic:
    """One router's state: the prefix index, in-flight counts, last reports."""

    def __init__(self, config: RoutingConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.index = PrefixIndex(config.pending_ttl_s, clock=clock)
        self._in_flight: dict[str, int] = {}  # replica -> sequences routed, not finished
        self._request_replica: dict[str, tuple[str, int]] = {}  # id -> (replica, seqs)
        self._reports: dict[str, ReplicaReport] = {}
        self._turn = 0

    # ------------------------------------------------------------------ inputs
    def observe_report(self, replica: str, report: ReplicaReport | None) -> None:
        """Take a replica's latest report (a repeat of the last one is cheap)."""
        if report is None:
            return
        last = self._reports.get(replica)
        if last is not None and last.epoch == report.epoch and last.seq >= report.seq:
            return
        self._reports[replica] = report
        self.index.apply_report(replica, report.epoch, report.seq, unpack_keys(report.cached_keys))

    def request_finished(self, request_id: str) -> None:
        """The request ended on its replica (any outcome). Unknown ids are ignored."""
        routed = self._request_replica.pop(request_id, None)
        if routed is not None and routed[0] in self._in_flight:
            replica, num_seqs = routed
            self._in_flight[replica] = max(0, self._in_flight[replica] - num_seqs)
        self.index.request_finished(request_id)

    def retain(self, replicas: Sequence[str]) -> None:
        """Forget replicas not in ``replicas`` (they died or were scaled away)."""
        keep = set(replicas)
        self.index.retain(keep)
        for d in (self._in_flight, self._reports):
            for r in [r for r in d if r not in keep]:
                del d[r]

    # ------------------------------------------------------------------ queries
    def known_replicas(self) -> frozenset[str]:
        """Every replica this logic holds anything for (index, loads, reports)."""
        return frozenset(self.index.replicas) | set(self._in_flight) | set(self._reports)

    def queue_len(self, replica: str) -> int:
        report = self._reports.get(replica)
        reported = report.num_running + report.num_waiting if report else 0
        return max(self._in_flight.get(replica, 0), reported)

    def free_blocks(self, replica: str) -> int | None:
        report = self._reports.get(replica)
        return report.num_free_blocks if report else None

    def in_flight(self, replica: str) -> int:
        return self._in_flight.get(replica, 0)

    # ------------------------------------------------------------------ the choice
    def choose(
        self,
        candidates: Sequence[str],
        keys: Sequence[bytes] = (),
        *,
        request_id: str | None = None,
        num_blocks_needed: int | None = None,
        num_seqs: int = 1,
    ) -> Decision:
        """Rank ``candidates`` for a request whose full blocks have index ``keys``
        (:func:`~kvserve.cluster.prefix_index.block_key` of the engine's hashes).

        With a ``request_id`` the choice is recorded: the chosen replica's in-flight
        count goes up by ``num_seqs`` (the request's samples, which all run there) and
        the index marks its keys pending there (call :meth:`request_finished` later).
        ``num_blocks_needed``: the KV blocks the request will take (default
        ``len(keys) + 1``). Raises ValueError when there is no candidate or
        ``num_seqs`` < 1.
        """
        if not candidates:
            raise ValueError("no replica to route to: the deployment has no running replica")
        if num_seqs < 1:
            raise ValueError(f"invalid num_seqs={num_seqs!r}: a request has at least 1 sequence")
        n = len(keys)
        policy = self.config.policy
        # Ties of the prefix-aware score (no replica known to hold the prefix, equal
        # loads) go to the replica the leading block hashes to, so every router (one
        # per ingress) sends a new prefix to the same replica before any report says
        # where it lives; requests without a full block rotate.
        if policy == "prefix-aware" and keys:
            order = _rendezvous(candidates, keys[0])
        else:
            order = self._rotation(candidates)
        scores: dict[str, float] = {}
        matched = {r: 0 for r in candidates}
        if policy == "round-robin":
            ranked = order
            reason = ROUND_ROBIN
        elif policy == "least-loaded":
            ranked = sorted(order, key=self.queue_len)
            reason = LEAST_LOADED
        else:
            matched = {r: self.index.matched_blocks(r, keys) for r in candidates}
            needed = n + 1 if num_blocks_needed is None else num_blocks_needed
            scores = {r: self._score(r, matched[r], n, needed) for r in candidates}
            ranked = sorted(
                order, key=lambda r: (-scores[r], self.queue_len(r), self.index.num_keys(r))
            )
            best_match = max(matched.values())
            if best_match == 0 and keys and self.config.routers > 1:
                ranked = self._bounded_rendezvous(order, ranked, needed, num_seqs)
            if best_match == 0:
                reason = NO_PREFIX
            elif matched[ranked[0]] == best_match:
                reason = PREFIX_HIT
            else:
                reason = LOAD_OVER_PREFIX
        chosen = ranked[0]
        if request_id is not None:
            self._record(chosen, request_id, keys, num_seqs)
        return Decision(chosen, policy, reason, matched[chosen], n, tuple(ranked), scores)

    def _score(self, replica: str, matched: int, n: int, needed: int) -> float:
        c = self.config
        score = (matched / n if n else 0.0) - c.queue_weight * self.queue_len(replica)
        free = self.free_blocks(replica)
        if free is not None and needed > free:
            score -= c.kv_weight * (needed - free) / max(n, 1)
        return score

    def _bounded_rendezvous(
        self, order: Sequence[str], ranked: Sequence[str], needed: int, num_seqs: int
    ) -> list[str]:
        """``order`` (rendezvous order) keeping only replicas under the load bound
        whose free KV fits ``needed`` blocks, then the rest as ``ranked``."""
        loads = {r: self.queue_len(r) for r in order}
        bound = math.ceil(1.25 * (sum(loads.values()) + num_seqs) / len(order))
        fits = [
            r
            for r in order
            if loads[r] + num_seqs <= bound
            and ((free := self.free_blocks(r)) is None or needed <= free)
        ]
        return fits + [r for r in ranked if r not in fits]

    def _rotation(self, candidates: Sequence[str]) -> list[str]:
        """The candidates in a stable order, rotated one step per call (tie breaks)."""
        ordered = sorted(candidates)
        k = self._turn % len(ordered)
        self._turn += 1
        return ordered[k:] + ordered[:k]

    def _record(self, replica: str, request_id: str, keys: Sequence[bytes], num_seqs: int) -> None:
        previous = self._request_replica.get(request_id)
        if previous is not None and previous[0] in self._in_flight:  # a retry moved it
            old, old_seqs = previous
            self._in_flight[old] = max(0, self._in_flight[old] - old_seqs)
        self._request_replica[request_id] = (replica, num_seqs)
        self._in_flight[replica] = self._in_flight.get(replica, 0) + num_seqs
        if self.config.policy == "prefix-aware":
            self.index.record_routed(replica, request_id, keys)
