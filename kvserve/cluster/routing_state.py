"""What the ingress process's replica watch tells its request router: the replicas
to leave out; and what the router tells the ingress: how often it ranked each
replica first, and the replicas it holds state for (prefix index, loads).

A module of its own because Ray Serve pickles the router's module *by value*
(``RequestRouterConfig`` registers it with ``cloudpickle.register_pickle_by_value``):
globals of ``router.py`` are copies in the process that runs the router, while this
module is pickled by reference, so the router and ``RemoteEngine`` (both in the
ingress process) share this one. Thread-safe: the router runs on Serve's router
loop, the watch on the ingress's loop.
"""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_excluded: frozenset[str] = frozenset()
_chosen: Counter[str] = Counter()  # replica -> times ranked first
_known: frozenset[str] = frozenset()  # replicas the router holds state for


def exclude_replicas(names: frozenset[str]) -> None:
    """Keep the replicas ``names`` (``replica_id.unique_id``) out of every routing
    decision of this process from now on; replaces the previous set."""
    global _excluded
    _excluded = frozenset(names)


def excluded_replicas() -> frozenset[str]:
    return _excluded


def count_chosen(replica: str) -> None:
    with _lock:
        _chosen[replica] += 1


def chosen_counts() -> dict[str, int]:
    """{replica: times a router of this process ranked it first} (a copy)."""
    with _lock:
        return dict(_chosen)


def note_known(names: frozenset[str]) -> None:
    """The router holds state (index entries, loads, reports) for exactly ``names``."""
    global _known
    _known = frozenset(names)


def known_replicas() -> frozenset[str]:
    """The replicas the router of this process last said it holds state for
    (``/cluster/replicas``: a replica scaled away leaves this at once)."""
    return _known
