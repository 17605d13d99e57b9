"""What the KV cache manager needs from a KV tier below RAM (``kvserve.kv_offload``):
a protocol, so the manager stays free of tensors and files.

Rules the manager keeps: every call is on the engine thread; ``save`` is called with
blocks whose KV is final and before those blocks can be written again (when a full
block is first cached, and when a cached block is evicted, inside the allocation
that reuses it); ``load`` only into blocks the manager holds and has not handed to
any request yet. Rules an implementation keeps: none of the three raises (a failure
is logged and reads as "not stored" / "not loaded"); ``contains`` does no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvserve.kv_cache.hashing import BlockHash


class KVTier(Protocol):
    def contains(self, block_hash: BlockHash) -> bool:
        """Whether the tier may hold this block (a load can still fail)."""
        ...

    def save(self, blocks: Sequence[tuple[BlockHash, tuple[int, ...], int]]) -> None:
        """Copy the KV of (hash, token ids, block id) blocks out now, store them later."""
        ...

    def load(self, blocks: Sequence[tuple[BlockHash, tuple[int, ...], int]]) -> int:
        """Write the stored (hash, token ids) blocks into their block ids, in order, up
        to the first that is absent or rejected; return how many were written."""
        ...
