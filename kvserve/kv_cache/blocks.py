"""The blocks the KV cache manager hands the scheduler (as vLLM's ``KVCacheBlocks``).

The scheduler never reads a block's fields: it passes a prefix hit from
:meth:`~kvserve.kv_cache.manager.KVCacheManager.get_computed_blocks` back to
``allocate_slots`` unchanged, counts the blocks (``len``) and sends their ids to the
runner (:meth:`KVCacheBlocks.get_block_ids`). Only the manager (and its tests)
looks inside.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from kvserve.kv_cache.block_pool import KVCacheBlock


@dataclass(frozen=True, slots=True)
class KVCacheBlocks(Sequence[KVCacheBlock]):
    """An immutable run of blocks, in token order."""

    blocks: tuple[KVCacheBlock, ...] = ()

    def get_block_ids(self) -> list[int]:
        """The blocks' ids, in order (what the model runner's block table holds)."""
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self.blocks)

    @overload
    def __getitem__(self, i: int) -> KVCacheBlock: ...
    @overload
    def __getitem__(self, i: slice) -> KVCacheBlocks: ...
    def __getitem__(self, i: int | slice) -> KVCacheBlock | KVCacheBlocks:
        if isinstance(i, slice):
            return KVCacheBlocks(self.blocks[i])
        return self.blocks[i]


EMPTY = KVCacheBlocks()
