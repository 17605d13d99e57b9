"""The decode worker's view of its prefill peers: alive or not, and how loaded.

A peer is alive while it answered a ping within ``stale_s``; one that stops
answering is skipped, one that answers again is used again. :meth:`PeerTable.choose`
picks the alive peer with the least work: its last reported load plus the requests
this decode worker sent it since (ties: the peer used longest ago). The set of peers
may change (:meth:`PeerTable.set_addresses`): a peer taken out is not alive.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Peer:
    address: str
    last_pong: float = float("-inf")
    reported_load: int = 0
    in_flight: int = 0
    last_used: int = 0


class PeerTable:
    """Not thread-safe: the caller (the decode connector) holds its own lock."""

    def __init__(self, addresses: list[str], clock: Callable[[], float], stale_s: float) -> None:
        self._peers = {a: _Peer(a) for a in addresses}
        self._clock = clock
        self.stale_s = stale_s
        self._uses = itertools.count(1)

    @property
    def addresses(self) -> list[str]:
        return list(self._peers)

    def set_addresses(self, addresses: list[str]) -> None:
        """Use exactly ``addresses`` from now on: new ones start not alive (until they
        answer a ping), peers not listed are forgotten."""
        self._peers = {a: self._peers.get(a) or _Peer(a) for a in addresses}

    def alive(self) -> list[str]:
        """The alive peers' addresses."""
        return [a for a in self._peers if self.is_alive(a)]

    def load(self, address: str) -> int:
        """The peer's last reported load plus what this worker sent it since (0 for
        an unknown peer)."""
        peer = self._peers.get(address)
        return 0 if peer is None else peer.reported_load + peer.in_flight

    def pong(self, address: str, load: int) -> None:
        peer = self._peers.get(address)
        if peer is not None:
            peer.last_pong = self._clock()
            peer.reported_load = load

    @property
    def any_answered(self) -> bool:
        """Whether some peer has answered a ping at least once (since start)."""
        return any(p.last_pong > float("-inf") for p in self._peers.values())

    def is_alive(self, address: str) -> bool:
        peer = self._peers.get(address)
        return peer is not None and self._clock() - peer.last_pong <= self.stale_s

    def choose(self) -> str | None:
        """The least-loaded alive peer, or None when none is alive."""
        alive = [p for p in self._peers.values() if self.is_alive(p.address)]
        if not alive:
            return None
        best = min(alive, key=lambda p: (p.reported_load + p.in_flight, p.last_used))
        best.last_used = next(self._uses)
        return best.address

    def started(self, address: str) -> None:
        peer = self._peers.get(address)
        if peer is not None:
            peer.in_flight += 1

    def ended(self, address: str) -> None:
        peer = self._peers.get(address)
        if peer is not None:  # a peer taken out keeps no count
            peer.in_flight = max(0, peer.in_flight - 1)
