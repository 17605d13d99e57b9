"""PrefixIndex: which engine replica probably holds which prefix-cache blocks.

Keys are the engine's own chained block hashes (``kv_cache/hashing.py``: parent hash,
block tokens, and for block 0 the model fingerprint and ``cache_salt``), cut to
their first :data:`KEY_BYTES` bytes. Because the chain carries the salt and every
earlier block, "replica R holds the key of block i" means R holds the whole prefix
up to block i for that salt; two tenants with different salts never share a key.

Two sources keep the index near the truth::

    routing decision ──▶ record_routed(replica, request_id, keys)   "pending": the
                          replica will cache these blocks when it runs the request;
                          kept while the request runs and pending_ttl_s after it ends
    replica report   ──▶ apply_report(replica, epoch, seq, keys)     "confirmed": the
                          exact set the replica's prefix cache holds now (its
                          evictions since the last report drop out)

A key is *held* by a replica when it is confirmed there, or pending there (its
request still running, or ended less than ``pending_ttl_s`` ago: the replica's next
report will confirm or drop it). Rules a caller must keep: one thread uses an index
(the router's event loop); ``clock`` is monotonic seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

KEY_BYTES = 8


def block_key(block_hash: bytes) -> bytes:
    """The index key of one engine block hash (its first ``KEY_BYTES`` bytes).

    A collision (2**-64 per pair) can only misroute a request: the engine confirms
    every prefix hit by the block's token ids."""
    return bytes(block_hash[:KEY_BYTES])


def pack_keys(keys: Iterable[bytes]) -> bytes:
    """Keys as one bytes value (what a replica report carries)."""
    return b"".join(keys)


def unpack_keys(packed: bytes) -> set[bytes]:
    """The inverse of :func:`pack_keys`; raises ValueError on a ragged length."""
    if len(packed) % KEY_BYTES:
        raise ValueError(
            f"a packed key list must be a multiple of {KEY_BYTES} bytes, got {len(packed)}"
        )
    return {packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)}


@dataclass
class _Pending:
    running: int = 0  # requests routed here that carry this key and have not ended
    expires: float = 0.0  # when running drops to 0: the key stays held until then


@dataclass
class _ReplicaEntry:
    confirmed: set[bytes] = field(default_factory=set)
    pending: dict[bytes, _Pending] = field(default_factory=dict)
    epoch: str | None = None  # the replica process that sent the last report
    seq: int = -1  # that report's sequence number


class PrefixIndex:
    """See the module docstring."""

    def __init__(
        self, pending_ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not pending_ttl_s >= 0:
            raise ValueError(
                f"invalid pending_ttl_s={pending_ttl_s!r}: must be >= 0 seconds "
                "(for example: pending_ttl_s=5.0)"
            )
        self.pending_ttl_s = pending_ttl_s
        self._clock = clock
        self._replicas: dict[str, _ReplicaEntry] = {}
        # request id -> (replica, keys) for requests routed and not yet ended
        self._requests: dict[str, tuple[str, tuple[bytes, ...]]] = {}

    # ------------------------------------------------------------------ queries
    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def matched_blocks(self, replica: str, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the replica holds (stops at the first miss)."""
        entry = self._replicas.get(replica)
        if entry is None:
            return 0
        now = self._clock()
        n = 0
        for key in keys:
            if key in entry.confirmed:
                n += 1
                continue
            p = entry.pending.get(key)
            if p is None or (p.running == 0 and p.expires <= now):
                break
            n += 1
        return n

    def num_keys(self, replica: str) -> int:
        """Confirmed keys of ``replica`` (its last report)."""
        entry = self._replicas.get(replica)
        return len(entry.confirmed) if entry else 0

    # ------------------------------------------------------------------ updates
    def record_routed(self, replica: str, request_id: str, keys: Sequence[bytes]) -> None:
        """The router sent ``request_id`` (its block keys) to ``replica``. Calling it
        again for the same request moves it (a retry chose another replica)."""
        if request_id in self._requests:
            self.request_finished(request_id, ttl_s=0.0)
        entry = self._replicas.setdefault(replica, _ReplicaEntry())
        for key in keys:
            entry.pending.setdefault(key, _Pending()).running += 1
        self._requests[request_id] = (replica, tuple(keys))

    def request_finished(self, request_id: str, ttl_s: float | None = None) -> None:
        """The request ended (any outcome): its pending keys stay held ``ttl_s``
        seconds more (default ``pending_ttl_s``). Unknown ids are ignored."""
        found = self._requests.pop(request_id, None)
        if found is None:
            return
        replica, keys = found
        entry = self._replicas.get(replica)
        if entry is None:
            return
        expires = self._clock() + (self.pending_ttl_s if ttl_s is None else ttl_s)
        for key in keys:
            p = entry.pending.get(key)
            if p is None:
                continue
            p.running = max(0, p.running - 1)
            if p.running == 0:
                p.expires = max(p.expires, expires)

    def apply_report(self, replica: str, epoch: str, seq: int, keys: set[bytes]) -> bool:
        """Replace the confirmed keys of ``replica`` with a report of what its prefix
        cache holds (``epoch`` names the replica process, ``seq`` orders its reports).

        Returns False and changes nothing for a report already applied or older than
        the last one of the same epoch. A new epoch (the replica restarted) replaces
        everything (blocks the replica evicted since its last report are no longer
        held); expired pending keys are dropped.
        """
        entry = self._replicas.setdefault(replica, _ReplicaEntry())
        if entry.epoch == epoch and seq <= entry.seq:
            return False
        if entry.epoch != epoch:
            entry.confirmed = set()
        entry.confirmed = keys
        entry.epoch, entry.seq = epoch, seq
        now = self._clock()
        for key in [k for k, p in entry.pending.items() if p.running == 0 and p.expires <= now]:
            del entry.pending[key]
        return True

    def remove_replica(self, replica: str) -> None:
        """Forget a replica (it died or left); its running requests are forgotten too."""
        self._replicas.pop(replica, None)
        for request_id in [r for r, (rep, _) in self._requests.items() if rep == replica]:
            del self._requests[request_id]

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget every replica not in ``replicas``."""
        keep = set(replicas)
        for replica in [r for r in self._replicas if r not in keep]:
            self.remove_replica(replica)
