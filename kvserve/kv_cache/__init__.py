"""Paged KV cache with block-level prefix caching (pure Python, no tensors).

The scheduler talks only to :class:`KVCacheManager`; the pool and hashing are its parts.
"""

from __future__ import annotations

from kvserve.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvserve.kv_cache.hashing import (
    HASH_ALGOS,
    BlockHash,
    hash_block_tokens,
    model_fingerprint,
    request_extra_keys,
)
from kvserve.kv_cache.manager import KVCacheManager, cdiv

__all__ = [
    "HASH_ALGOS",
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "cdiv",
    "hash_block_tokens",
    "model_fingerprint",
    "request_extra_keys",
]
