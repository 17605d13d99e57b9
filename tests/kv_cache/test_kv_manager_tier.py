"""KVCacheManager with a KV tier below RAM (a dict stands in for the disk tier):
saves on cache and on eviction, loads past the first RAM miss, every block
accounted for when a load fails."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.kv_cache import KVCacheManager
from kvserve.kv_cache.hashing import BlockHash
from kvserve.request import Request, SamplingParams

BS = 4


class DictTier:
    """Stores (tokens, the block id's "KV") per hash; ``fail``: hashes whose load fails."""

    def __init__(self) -> None:
        self.kv: dict[int, str] = {}  # block id -> what it holds (the fake cache)
        self.stored: dict[BlockHash, tuple[tuple[int, ...], str]] = {}
        self.fail: set[BlockHash] = set()
        self.saves = 0
        self.loads: list[int] = []

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.stored

    def save(self, blocks: Sequence[tuple[BlockHash, tuple[int, ...], int]]) -> None:
        for h, tokens, block_id in blocks:
            self.saves += 1
            self.stored.setdefault(h, (tokens, self.kv.get(block_id, "")))

    def load(self, blocks: Sequence[tuple[BlockHash, tuple[int, ...], int]]) -> int:
        for n, (block_hash, token_ids, block_id) in enumerate(blocks):
            item = self.stored.get(block_hash)
            if item is None or item[0] != token_ids or block_hash in self.fail:
                return n
            self.kv[block_id] = item[1]
            self.loads.append(block_id)
        return len(blocks)


def _req(req_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(), cache_salt=salt)


def _run(kv: KVCacheManager, tier: DictTier, req: Request) -> int:
    """Admit, "compute" (tag each block with its tokens), cache, free; the hit tokens."""
    blocks, n = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - n, blocks, n)
    assert new is not None
    for i, b in enumerate(kv.req_to_blocks[req.req_id]):
        if i >= len(blocks):
            tier.kv[b.block_id] = repr(req.all_token_ids[i * BS : (i + 1) * BS])
        else:  # a hit must hold exactly what computing it would give
            assert tier.kv[b.block_id] == repr(req.all_token_ids[i * BS : (i + 1) * BS])
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_tokens)
    kv.free(req)
    kv.check_invariants()
    return n


def test_evicted_blocks_come_back_from_the_tier() -> None:
    tier = DictTier()
    kv = KVCacheManager(8, BS, 64, kv_tier=tier)  # 7 usable blocks
    a = list(range(100, 125))  # 6 full blocks + 1 token
    assert _run(kv, tier, _req("a", a)) == 0
    assert tier.saves == 6  # written through when cached
    b = list(range(500, 525))
    assert _run(kv, tier, _req("b", b)) == 0  # evicts a's blocks
    assert _run(kv, tier, _req("a2", a)) == 24  # all six loaded back
    assert len(tier.loads) == 6
    assert kv.num_active_blocks == 0


def test_mixed_ram_and_tier_chain() -> None:
    tier = DictTier()
    kv = KVCacheManager(16, BS, 64, kv_tier=tier)
    a = list(range(100, 117))  # 4 full blocks + 1
    _run(kv, tier, _req("a", a))
    # drop block 1 of the chain from RAM only: the rest stays cached
    h1 = _req("x", a).block_hashes or kv.block_hashes(_req("x", a))
    block = kv.block_pool.cached[h1[1]]
    kv.block_pool.touch([block])
    kv.block_pool.free_blocks([block])
    kv.block_pool._evict(block)  # as the pool's eviction would (test-only)
    kv.block_pool.free_queue.remove(block)
    kv.block_pool.free_queue.appendleft(block)
    kv.block_pool._add_empty(block.block_id)
    kv.check_invariants()
    assert _run(kv, tier, _req("a2", a)) == 16
    assert len(tier.loads) == 1


def test_failed_load_ends_the_hit_and_leaks_nothing() -> None:
    tier = DictTier()
    kv = KVCacheManager(8, BS, 64, kv_tier=tier)
    a = list(range(100, 125))
    _run(kv, tier, _req("a", a))
    _run(kv, tier, _req("b", list(range(500, 525))))
    hashes = kv.block_hashes(_req("x", a))
    tier.fail.add(hashes[3])  # blocks 0-2 load, 3 fails: recompute from block 3
    free_before = kv.num_free_blocks
    blocks, n = kv.get_computed_blocks(_req("a2", a))
    assert n == 3 * BS and len(blocks) == 3
    kv.check_invariants()
    assert kv.num_active_blocks == 0 and kv.num_free_blocks == free_before
    assert _run(kv, tier, _req("a3", a)) == 3 * BS


def test_salt_isolates_the_tier() -> None:
    tier = DictTier()
    kv = KVCacheManager(8, BS, 64, kv_tier=tier)
    a = list(range(100, 125))
    _run(kv, tier, _req("a", a, salt="tenant-1"))
    _run(kv, tier, _req("b", list(range(500, 525))))
    assert _run(kv, tier, _req("c", a, salt="tenant-2")) == 0
    assert _run(kv, tier, _req("d", a)) == 0
    assert not tier.loads
    _run(kv, tier, _req("e", list(range(700, 725))))
    assert _run(kv, tier, _req("f", a, salt="tenant-1")) == 24


def test_no_tier_without_caching() -> None:
    tier = DictTier()
    kv = KVCacheManager(8, BS, 64, enable_caching=False, kv_tier=tier)
    assert kv.kv_tier is None
    _run(kv, tier, _req("a", list(range(100, 125))))
    assert tier.saves == 0
