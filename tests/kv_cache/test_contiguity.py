"""The block pool's allocation order keeps each request's blocks in runs of
consecutive ids (kvserve/kv_cache/block_pool.py, "Allocation order"), which the
decode kernel reads as one stream per KV head, without bending the eviction order
of cached blocks."""

from __future__ import annotations

import random

import pytest

from kvserve.bench.kv_placement import adjacent_fraction, engine_block_tables
from kvserve.kv_cache import KVCacheBlock
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.hashing import BlockHash


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "little"))


def toks(i: int) -> tuple[int, ...]:
    return (i, i, i, i)


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_adjacent_fraction() -> None:
    assert adjacent_fraction([]) == adjacent_fraction([5]) == 1.0
    assert adjacent_fraction([3, 4, 5, 9, 10]) == 0.75
    assert adjacent_fraction([5, 4, 3]) == 0.0


@pytest.mark.parametrize("caching", [False, True])
def test_sixteen_requests_prefilled_then_decoding_together_stay_contiguous(caching: bool) -> None:
    # 16 prompts admitted at once, chunked prefill (512-token budget) with the first
    # ones decoding beside the later prompts, then all 16 decoding 512 more tokens:
    # the order of the free queue alone interleaves their decode blocks (about half
    # of each table's pairs adjacent); the pool keeps them apart.
    tables = engine_block_tables(
        16, 1024, decode_tokens=512, max_num_batched_tokens=512, enable_caching=caching
    )
    assert len(tables) == 16 and all(len(t) == 65 for t in tables)
    assert len({b for t in tables for b in t}) == 16 * 65
    fractions = [adjacent_fraction(t) for t in tables]
    assert min(fractions) >= 0.9, fractions


def test_after_churn_without_caching_runs_coalesce_and_stay_contiguous() -> None:
    # random requests come and go (chunked prefills, one-block growth interleaved
    # between them, frees in any order); freed blocks merge back into runs, so a
    # batch growing together afterwards is still laid out in long runs
    rng = random.Random(0)
    pool = BlockPool(1 + 16 * 40, enable_caching=False)
    live: dict[int, list[KVCacheBlock]] = {}
    for step in range(3000):
        if live and (rng.random() < 0.04 or pool.num_free_blocks < 8):
            pool.free_blocks(reversed(live.pop(rng.choice(sorted(live)))))
        elif rng.random() < 0.1 or not live:
            live[step] = pool.get_new_blocks(rng.randint(1, 8))
        else:
            blocks = live[rng.choice(sorted(live))]
            blocks.extend(pool.get_new_blocks(1, blocks[-1]))
        if step % 100 == 0:
            pool.check_invariants()
    for blocks in live.values():
        pool.free_blocks(reversed(blocks))
    pool.check_invariants()
    assert pool._run_end == {1: pool.num_blocks - 1}  # one run again, whatever the churn
    tables = [pool.get_new_blocks(4) for _ in range(16)]  # 16 prefills of 4 blocks, then
    for _ in range(30):  # 30 decode blocks each, round robin
        for t in tables:
            t.extend(pool.get_new_blocks(1, t[-1]))
    pool.check_invariants()
    fractions = [adjacent_fraction(ids(t)) for t in tables]
    assert min(fractions) >= 0.85 and sum(fractions) / 16 >= 0.95, fractions


def test_contiguity_never_evicts_out_of_lru_order() -> None:
    pool = BlockPool(9)  # blocks 1..8
    a = pool.get_new_blocks(3)
    assert ids(a) == [1, 2, 3]  # a fresh pool hands out one run from the start
    b = pool.get_new_blocks(2, a[-1])
    assert ids(b) == [4, 5]  # after = 3: 4 and 5 follow
    for i, blk in enumerate(a + b):
        assert pool.cache_block(blk, h(i), toks(i))
    pool.free_blocks(reversed(b))  # 5, 4 at the back of the queue (cached)
    (x,) = pool.get_new_blocks(1, a[-1])
    # block 4 (after 3) is cached: not taken while empty blocks exist
    assert x.block_id in (6, 7, 8) and pool.get_cached_block(h(3), toks(3)) is b[0]
    rest = pool.get_new_blocks(2)
    assert {x.block_id, *ids(rest)} == {6, 7, 8}
    pool.check_invariants()
    # no empty block left: the LRU front is evicted (5 before 4, freed tail first),
    # whatever ``after`` asks for
    pool.free_blocks(reversed(a))  # queue: 5, 4, 3, 2, 1
    (y,) = pool.get_new_blocks(1, x)
    assert y.block_id == 5 and h(4) not in pool.cached and h(3) in pool.cached
    # several evicted at once: exactly the LRU front (4, 3, 2), handed out ascending
    got = pool.get_new_blocks(3, y)
    assert ids(got) == [2, 3, 4]
    assert set(pool.cached) == {h(0)}
    pool.check_invariants()


def test_new_run_leaves_room_after_a_held_block() -> None:
    pool = BlockPool(101)  # blocks 1..100
    a = pool.get_new_blocks(10)
    assert ids(a) == list(range(1, 11))
    (b,) = pool.get_new_blocks(1)  # a new request: the middle of 11..100, not 11
    assert b.block_id == 11 + 90 // 2
    nxt = pool.get_new_blocks(1, a[-1])
    assert ids(nxt) == [11]  # a keeps growing in place
    pool.free_blocks(reversed(a + nxt))
    (c,) = pool.get_new_blocks(1)  # the longest run is 1..55 and nothing is held before it
    assert c.block_id == 1
    pool.check_invariants()


def test_hit_on_an_empty_block_and_reset_keep_the_run_index() -> None:
    pool = BlockPool(12)
    blocks = pool.get_new_blocks(6)
    for i, blk in enumerate(blocks[:3]):
        pool.cache_block(blk, h(i), toks(i))
    pool.free_blocks(reversed(blocks))  # 4..6 empty again, 1..3 cached
    pool.check_invariants()
    pool.touch([pool.blocks[8]])  # an empty block taken from the middle of its run
    pool.check_invariants()
    assert 8 not in pool._run_end and pool._run_end[4] == 7 and pool._run_end[9] == 11
    pool.free_blocks([pool.blocks[8]])
    assert pool._run_end == {4: 11}
    assert pool.reset_prefix_cache()
    assert pool._run_end == {1: 11}
    pool.check_invariants()


def test_stale_heap_entries_stay_bounded() -> None:
    pool = BlockPool(1 + 2000, enable_caching=False)
    tables = [pool.get_new_blocks(1) for _ in range(8)]
    for _ in range(200):
        for t in tables:
            t.extend(pool.get_new_blocks(1, t[-1]))
    assert len(pool._run_heap) <= 2 * len(pool._run_end) + 64
    pool.check_invariants()
