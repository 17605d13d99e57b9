"""Block pool: null block, free-queue order and O(1) removal, eviction, counts, reset."""

from __future__ import annotations

import pytest

from kvserve.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvserve.kv_cache.hashing import BlockHash


def ids(blocks: object) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def h(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(32, "little"))


def toks(n: int) -> tuple[int, ...]:
    return (n,) * 4


def counts(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_active_blocks, pool.num_reclaimable_blocks, pool.num_empty_blocks


# -- FreeBlockQueue -------------------------------------------------------------------


def test_free_queue_order_and_middle_removal() -> None:
    blocks = [KVCacheBlock(i) for i in range(1, 6)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [1, 2, 3, 4, 5] and len(q) == 5
    q.remove(blocks[2])
    assert ids(q) == [1, 2, 4, 5] and len(q) == 4
    assert blocks[2] not in q and blocks[1] in q
    q.appendleft(blocks[2])
    assert ids(q) == [3, 1, 2, 4, 5]
    assert q.popleft().block_id == 3
    q.remove(blocks[4])  # the back
    q.remove(blocks[0])  # the front
    assert ids(q) == [2, 4]
    q.append(blocks[0])
    assert ids(q) == [2, 4, 1]
    assert [q.popleft().block_id for _ in range(3)] == [2, 4, 1]
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_rejects_double_insert_and_foreign_remove() -> None:
    b = KVCacheBlock(1)
    q = FreeBlockQueue([b])
    with pytest.raises(RuntimeError, match="already in the free queue"):
        q.append(b)
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(KVCacheBlock(2))


# -- BlockPool ----------------------------------------------------------------------


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(8)
    got = pool.get_new_blocks(7)
    assert sorted(ids(got)) == [1, 2, 3, 4, 5, 6, 7]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 0
    with pytest.raises(RuntimeError, match="cannot allocate 1 blocks: only 0 free"):
        pool.get_new_blocks(1)
    pool.check_invariants()


@pytest.mark.parametrize("bad", [0, 1, -3, 2.5, True])
def test_pool_size_validation(bad: object) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)  # type: ignore[arg-type]


def test_three_counts_are_disjoint_and_sum_to_usable() -> None:
    pool = BlockPool(11)
    assert counts(pool) == (0, 0, 10)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks[:3]):
        assert pool.cache_block(b, h(i), toks(i))
    assert counts(pool) == (4, 0, 6)  # cached but held: active, not reclaimable
    pool.free_blocks(reversed(blocks))
    assert counts(pool) == (0, 3, 7)
    assert pool.num_free_blocks == 10  # reclaimable + empty, each counted once
    pool.touch([blocks[1]])  # a cache hit on a free cached block
    assert counts(pool) == (1, 2, 7)
    pool.check_invariants()


def test_eviction_order_unhashed_first_then_least_recently_freed_tail_first() -> None:
    pool = BlockPool(9)
    a = pool.get_new_blocks(3)  # request A: 3 full cached blocks
    b = pool.get_new_blocks(3)  # request B: 2 cached + 1 partial (unhashed)
    for i, blk in enumerate(a):
        pool.cache_block(blk, h(10 + i), toks(10 + i))
    for i, blk in enumerate(b[:2]):
        pool.cache_block(blk, h(20 + i), toks(20 + i))
    pool.free_blocks(reversed(a))  # A freed first, tail first
    pool.free_blocks(reversed(b))
    order = ids(pool.free_queue)
    # never-used empty blocks and B's partial block come first, then A tail->head, then B tail->head
    expected_cached = [a[2].block_id, a[1].block_id, a[0].block_id, b[1].block_id, b[0].block_id]
    assert order[-5:] == expected_cached
    never_used = set(range(1, 9)) - set(ids(a)) - set(ids(b))
    assert len(never_used) == 2 and set(order[:-5]) == never_used | {b[2].block_id}
    # allocation reuses the empty ones, then evicts A's tail before A's head
    got = pool.get_new_blocks(4)
    assert ids(got)[3] == a[2].block_id
    assert a[2].block_hash is None and h(12) not in pool.cached
    assert pool.get_cached_block(h(10), toks(10)) is a[0]  # the head survives
    assert counts(pool) == (4, 4, 0)
    pool.check_invariants()


def test_hit_confirmed_by_token_ids() -> None:
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, h(1), toks(1))
    assert pool.get_cached_block(h(1), toks(1)) is blk
    assert pool.get_cached_block(h(1), toks(2)) is None  # same hash, other tokens: a miss
    assert pool.get_cached_block(h(2), toks(1)) is None


def test_one_block_per_hash_existing_kept() -> None:
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    assert pool.cache_block(x, h(1), toks(1))
    assert not pool.cache_block(y, h(1), toks(1))
    assert y.block_hash is None and pool.cached[h(1)] is x
    pool.free_blocks([y, x])
    assert ids(pool.free_queue)[0] == y.block_id  # the uncached duplicate is reused first
    assert ids(pool.free_queue)[-1] == x.block_id
    pool.check_invariants()


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    (blk,) = pool.get_new_blocks(1)
    assert not pool.cache_block(blk, h(1), toks(1))
    pool.free_blocks([blk])
    assert counts(pool) == (0, 0, 3)


def test_reset_refused_while_active() -> None:
    pool = BlockPool(6)
    x, y = pool.get_new_blocks(2)
    pool.cache_block(x, h(1), toks(1))
    pool.free_blocks([x])
    assert not pool.reset_prefix_cache()
    assert pool.cached == {h(1): x} and x.block_hash == h(1)
    pool.free_blocks([y])
    assert pool.reset_prefix_cache()
    assert pool.cached == {} and x.block_hash is None
    assert counts(pool) == (0, 0, 5)
    pool.check_invariants()


def test_double_free_is_an_error() -> None:
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([blk])


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    blk.ref_cnt = 0  # held out of the queue but claims to be free
    with pytest.raises(RuntimeError, match="membership disagrees"):
        pool.check_invariants()
