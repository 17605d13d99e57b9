"""Plain data between the ingress, the router and the engine replicas (no ray here).

    ingress ── RoutedRequest ──▶ router (reads .keys, writes .decision) ──▶ replica
    replica ── Accepted | Refused, then RequestDelta ... (last one finished) ──▶ ingress

A replica's ``generate`` first yields exactly one :class:`Accepted` (the request is
queued in its engine) or one :class:`Refused` (nothing was queued: bad request, queue
full, shutting down), then, after ``Accepted``, the request's deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.cluster.policy import Decision
from kvserve.request import Request


@dataclass(frozen=True)
class EngineFacts:
    """What the ingress needs to know about the replicas' engine: to validate and
    tokenize requests, and to compute the engine's block hashes (every replica of a
    deployment runs the same model and cache settings)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    eos_token_ids: tuple[int, ...]
    model_fingerprint: str
    block_size: int
    hash_algo: str
    enable_prefix_caching: bool


@dataclass
class RoutedRequest:
    """One engine request on its way to a replica.

    ``request.block_hashes`` already holds the engine's chained hashes of its full
    blocks (computed once, at the ingress, with ``facts``); ``keys`` are their index
    keys. The router sets ``decision`` (the ingress reads it once the replica
    answered). ``hashed_with`` is the fingerprint/block size/algo the hashes were
    computed with: a replica whose engine differs drops them and rehashes.
    ``request`` is unsplit: its params still ask for every ``n``/``best_of``
    sample, which the replica forks (``Request.with_samples``)."""

    request: Request
    keys: tuple[bytes, ...]
    hashed_with: tuple[str, int, str]
    max_waiting: int | None = None
    decision: Decision | None = None

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs on its replica: its ``n``/``best_of`` samples
        (the ingress sends it unsplit; the replica forks them)."""
        if len(self.request.group) > 1:
            return len(self.request.group)
        return self.request.sampling_params.num_samples

    @property
    def num_blocks_needed(self) -> int:
        """KV blocks the request takes at most: the prompt's once (the samples share
        them), ``max_tokens`` per sample."""
        params = self.request.sampling_params
        tokens = len(self.request.prompt_token_ids) + self.num_seqs * (params.max_tokens or 0)
        return -(-tokens // self.hashed_with[1])


@dataclass(frozen=True)
class Accepted:
    """The replica queued the request."""

    replica: str


@dataclass(frozen=True)
class Refused:
    """The replica queued nothing. ``kind``: "request" (a RequestError: ``param``
    and ``code`` name the field), "queue_full" or "unavailable"."""

    kind: str
    message: str
    param: str | None = None
    code: str | int | None = None
