"""KVCacheManager: the seed examples exactly, plus allocation, eviction, stats, reset."""

from __future__ import annotations

import pytest

import kvserve.kv_cache.manager as manager_mod
from kvserve.kv_cache import KVCacheBlock, KVCacheManager
from kvserve.kv_cache.blocks import KVCacheBlocks
from kvserve.request import Request, SamplingParams


def req(
    req_id: str, tokens: list[int], *, cache_salt: str | None = None, adapter_id: str | None = None
) -> Request:
    return Request(req_id, tokens, SamplingParams(), cache_salt=cache_salt, adapter_id=adapter_id)


def admit(m: KVCacheManager, r: Request, num_new_tokens: int | None = None) -> int:
    """Lookup + allocate + compute (all remaining tokens unless given) + cache. Returns hit tokens."""
    blocks, hit = m.get_computed_blocks(r)
    n = r.num_tokens - hit if num_new_tokens is None else num_new_tokens
    assert m.allocate_slots(r, n, blocks, hit) is not None
    r.num_computed_tokens = hit + n
    m.cache_blocks(r, r.num_computed_tokens)
    return hit


def run_to_completion(m: KVCacheManager, r: Request) -> None:
    admit(m, r)
    m.free(r)


def snapshot(m: KVCacheManager) -> tuple:
    pool = m.block_pool
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_queue],
        dict(pool.cached),
        {k: list(v) for k, v in m.req_to_blocks.items()},
        (m.prefix_cache_queries, m.prefix_cache_hits, m.prefix_cache_hit_rate),
        (m.num_active_blocks, m.num_reclaimable_blocks, m.num_empty_blocks),
    )


# -- seed examples ------------------------------------------------------------------


def test_seed_2496_of_3000_at_block_16() -> None:
    m = KVCacheManager(400, 16, 4096)
    base = list(range(1, 2501))
    run_to_completion(m, req("base", base))
    assert m.num_reclaimable_blocks == 156  # 2500 // 16 full blocks cached; the partial one is not
    q = req("q", base + list(range(5000, 5500)))
    blocks, hit = m.get_computed_blocks(q)
    assert (len(blocks), hit, q.num_tokens - hit) == (156, 2496, 504)
    new = m.allocate_slots(q, q.num_tokens - hit, blocks, hit)
    assert new is not None and len(new) == 32  # cdiv(3000, 16) = 188 = 156 + 32
    assert len(m.get_block_ids("q")) == 188
    m.check_invariants()


def test_seed_token_5_changed_gets_nothing() -> None:
    m = KVCacheManager(64, 16, 1024)
    original = list(range(100, 164))
    run_to_completion(m, req("orig", original))
    mutated = list(original)
    mutated[5] = 999_999
    blocks, hit = m.get_computed_blocks(req("mut", mutated))
    assert (len(blocks), hit) == (0, 0)
    # the untouched sequence still hits (all but the last block: one token must be computed)
    assert m.get_computed_blocks(req("again", original))[1] == 48


def test_seed_cache_salt_isolation() -> None:
    m = KVCacheManager(400, 16, 4096)
    prompt = list(range(1, 2501))
    run_to_completion(m, req("a", prompt, cache_salt="tenant-a"))
    assert m.get_computed_blocks(req("b", prompt, cache_salt="tenant-b"))[1] == 0
    assert m.get_computed_blocks(req("none", prompt))[1] == 0
    assert m.get_computed_blocks(req("a2", prompt, cache_salt="tenant-a"))[1] == 2496


def test_adapter_isolation() -> None:
    m = KVCacheManager(100, 16, 1024)
    prompt = list(range(200))
    run_to_completion(m, req("a", prompt, adapter_id="lora-1"))
    assert m.get_computed_blocks(req("b", prompt, adapter_id="lora-2"))[1] == 0
    assert m.get_computed_blocks(req("c", prompt))[1] == 0
    assert m.get_computed_blocks(req("d", prompt, adapter_id="lora-1"))[1] == 192
    # the adapter and the salt are different kinds of key even when spelled alike
    run_to_completion(m, req("e", prompt, adapter_id="x"))
    assert m.get_computed_blocks(req("f", prompt, cache_salt="x"))[1] == 0


def test_model_fingerprint_isolation() -> None:
    prompt = list(range(200))
    m1 = KVCacheManager(100, 16, 1024, model_fingerprint="model-a")
    m2 = KVCacheManager(100, 16, 1024, model_fingerprint="model-b")
    r1, r2 = req("1", prompt), req("2", prompt)
    m1.get_computed_blocks(r1)
    m2.get_computed_blocks(r2)
    assert len(r1.block_hashes) == len(r2.block_hashes) == 12
    assert not set(r1.block_hashes) & set(r2.block_hashes)
    # a pool shared by two models (hashes of model-a's blocks present) still misses for model-b
    run_to_completion(m1, req("warm", prompt))
    m1.model_fingerprint = "model-b"
    assert m1.get_computed_blocks(req("other", prompt))[1] == 0
    m1.model_fingerprint = "model-a"
    assert m1.get_computed_blocks(req("same", prompt))[1] == 192


def test_seed_block_32_3072_of_4000() -> None:
    m = KVCacheManager(300, 32, 8192)
    system = list(range(10_000, 13_100))
    run_to_completion(m, req("sys", system))
    q = req("q", system + list(range(900)))
    blocks, hit = m.get_computed_blocks(q)
    assert (len(blocks), hit, q.num_tokens - hit) == (96, 3072, 928)


def test_seed_block_128_chunked_prefill_48_64_80() -> None:
    m = KVCacheManager(200, 128, 16_384)
    prefix = list(range(4096))
    run_to_completion(m, req("warm", prefix + [7]))
    r = req("long", prefix + list(range(50_000, 50_000 + 6144)))
    assert r.num_tokens == 10_240
    blocks, hit = m.get_computed_blocks(r)
    assert (len(blocks), hit) == (32, 4096)
    held = []
    for step in range(3):
        new = m.allocate_slots(r, 2048, blocks if step == 0 else None, hit if step == 0 else 0)
        assert new is not None and len(new) == 16
        r.num_computed_tokens += (hit if step == 0 else 0) + 2048
        m.cache_blocks(r, r.num_computed_tokens)
        held.append(len(m.get_block_ids("long")))
        m.check_invariants()
    assert held == [48, 64, 80]
    ids = m.get_block_ids("long")
    assert len(ids) == 80 <= m.max_blocks_per_req == 128
    assert all(i > 0 for i in ids)  # never the null block
    assert ids[:32] == [b.block_id for b in blocks]


# -- allocation ---------------------------------------------------------------------


def test_never_the_whole_prompt() -> None:
    m = KVCacheManager(20, 16, 1024)
    run_to_completion(m, req("a", list(range(64))))
    assert m.get_computed_blocks(req("same", list(range(64))))[1] == 48
    assert m.get_computed_blocks(req("longer", list(range(65))))[1] == 64
    assert m.get_computed_blocks(req("short", list(range(16))))[1] == 0


def test_incremental_allocation_through_decode() -> None:
    m = KVCacheManager(20, 4, 64)
    r = req("r", list(range(6)))
    new = m.allocate_slots(r, 6)
    assert new is not None and len(new) == 2
    r.num_computed_tokens = 6
    m.cache_blocks(r, 6)
    assert m.num_reclaimable_blocks == 0 and len(m.block_pool.cached) == 1
    grown = []
    for t in range(6):
        r.append_output_token_ids(100 + t)
        new = m.allocate_slots(r, 1)
        assert new is not None
        grown.append(len(new))
        r.num_computed_tokens += 1
        m.cache_blocks(r, r.num_computed_tokens)
    # tokens 7..12: a new block only when crossing 8 and 12
    assert grown == [0, 0, 1, 0, 0, 0]
    assert len(m.get_block_ids("r")) == 3 and len(m.block_pool.cached) == 3
    m.check_invariants()


def test_shared_prefix_ref_counts() -> None:
    m = KVCacheManager(40, 16, 1024)
    system = list(range(64))
    a = req("a", system + [1000, 1001])
    admit(m, a)
    b, c = req("b", system + [2000]), req("c", system + [3000, 3001, 3002])
    assert admit(m, b) == 64
    assert admit(m, c) == 64
    shared = m.req_to_blocks["a"][:4]
    assert m.req_to_blocks["b"][:4] == shared == m.req_to_blocks["c"][:4]
    assert [blk.ref_cnt for blk in shared] == [3, 3, 3, 3]
    assert m.num_active_blocks == 4 + 3  # shared prefix + one tail block each
    m.free(a)
    assert [blk.ref_cnt for blk in shared] == [2, 2, 2, 2]
    m.free(b)
    m.free(c)
    assert [blk.ref_cnt for blk in shared] == [0, 0, 0, 0]
    assert m.num_active_blocks == 0 and m.num_reclaimable_blocks == 4
    m.check_invariants()


def test_hit_on_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    m = KVCacheManager(10, 4, 64)
    run_to_completion(m, req("a", list(range(9))))
    assert m.num_reclaimable_blocks == 2
    r = req("b", list(range(9)))
    assert admit(m, r, 1) == 8
    assert m.num_reclaimable_blocks == 0 and m.num_active_blocks == 3
    assert all(b not in m.block_pool.free_queue for b in m.req_to_blocks["b"])
    m.check_invariants()


def test_none_and_nothing_changed_when_full() -> None:
    m = KVCacheManager(11, 4, 64)  # 10 usable blocks
    run_to_completion(m, req("warm", list(range(17))))  # 4 cached blocks, reclaimable
    filler = req("filler", list(range(500, 520)))  # 5 blocks, not sharing
    admit(m, filler)
    q = req("q", list(range(16)) + list(range(900, 920)))  # 36 tokens, 4 hit blocks + 5 new
    blocks, hit = m.get_computed_blocks(q)
    assert (len(blocks), hit) == (4, 16)
    # free = 5 (1 empty + 4 reclaimable) but the 4 hits are among them: only 1 left for 5 new
    before = snapshot(m)
    assert m.allocate_slots(q, q.num_tokens - hit, blocks, hit) is None
    assert snapshot(m) == before
    assert all(b.ref_cnt == 0 for b in blocks)
    # a plain request that needs more than the free blocks is refused too
    big = req("big", list(range(2000, 2024)))
    assert m.allocate_slots(big, 24) is None
    assert snapshot(m) == before
    m.check_invariants()
    m.free(filler)
    assert m.allocate_slots(q, q.num_tokens - hit, blocks, hit) is not None
    m.check_invariants()


def test_allocation_evicts_least_recently_freed_tail_first() -> None:
    m = KVCacheManager(9, 4, 64)  # 8 usable
    a, b = req("a", list(range(12)) + [99]), req("b", list(range(100, 112)) + [99])
    admit(m, a)  # 4 blocks: 3 cached + 1 partial
    admit(m, b)
    m.free(a)
    m.free(b)
    assert m.num_reclaimable_blocks == 6 and m.num_empty_blocks == 2
    # a 12-token request needs 3 blocks: the 2 partial (unhashed) blocks, then A's tail
    c = req("c", list(range(200, 212)))
    assert m.allocate_slots(c, 12) is not None
    assert m.get_computed_blocks(req("a2", list(range(12)) + [5]))[1] == 8
    assert m.get_computed_blocks(req("b2", list(range(100, 112)) + [5]))[1] == 12
    m.check_invariants()


def test_duplicate_content_keeps_the_existing_cached_block() -> None:
    m = KVCacheManager(20, 4, 64)
    prompt = list(range(9))
    a, b = req("a", prompt), req("b", prompt)
    # both admitted before either is computed: both miss, both compute
    for r in (a, b):
        blocks, hit = m.get_computed_blocks(r)
        assert hit == 0
        assert m.allocate_slots(r, 9, blocks, hit) is not None
    for r in (a, b):
        r.num_computed_tokens = 9
        m.cache_blocks(r, 9)
    a_blocks, b_blocks = m.req_to_blocks["a"], m.req_to_blocks["b"]
    assert all(blk.block_hash is not None for blk in a_blocks[:2])
    assert all(blk.block_hash is None for blk in b_blocks)
    m.check_invariants()
    m.free(b)
    # b's duplicates are empty blocks, reused before any cached block
    assert m.num_reclaimable_blocks == 0
    blocks, hit = m.get_computed_blocks(req("c", prompt))
    assert hit == 8 and list(blocks) == a_blocks[:2]


def test_stale_hit_blocks_are_rejected() -> None:
    m = KVCacheManager(4, 4, 64)  # 3 usable
    run_to_completion(m, req("a", list(range(9))))
    r = req("r", list(range(9)))
    blocks, hit = m.get_computed_blocks(r)
    assert hit == 8
    m.allocate_slots(req("other", list(range(50, 62))), 12)  # evicts both cached blocks
    with pytest.raises(ValueError, match="evicted since get_computed_blocks"):
        m.allocate_slots(r, 1, blocks, hit)


def test_protocol_errors() -> None:
    m = KVCacheManager(20, 4, 16)
    r = req("r", list(range(8)))
    with pytest.raises(ValueError, match="exceed max_model_len=16"):
        m.allocate_slots(r, 17)
    with pytest.raises(ValueError, match="must be >= 0"):
        m.allocate_slots(r, -1)
    with pytest.raises(ValueError, match="must equal len"):
        m.allocate_slots(r, 4, [], 4)
    blocks: list[KVCacheBlock] = []
    assert m.allocate_slots(r, 8, blocks, 0) is not None
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(1, 4, 16)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(10, 0, 16)
    with pytest.raises(ValueError, match="hash_algo"):
        KVCacheManager(10, 4, 16, hash_algo="md5")


def test_free_is_idempotent_and_unhashed_go_first() -> None:
    m = KVCacheManager(10, 4, 64)
    r = req("r", list(range(10)))  # 2 full + 1 partial
    admit(m, r)
    partial = m.req_to_blocks["r"][2]
    m.free(r)
    m.free(r)
    assert next(iter(m.block_pool.free_queue)) is partial
    m.check_invariants()


# -- counts, capacity, reset, stats --------------------------------------------------


def test_counts_and_usage() -> None:
    m = KVCacheManager(11, 4, 64)
    assert (m.num_active_blocks, m.num_reclaimable_blocks, m.num_empty_blocks) == (0, 0, 10)
    assert m.usage == 0.0 and m.num_free_blocks == 10
    r = req("r", list(range(10)))
    admit(m, r)
    assert (m.num_active_blocks, m.num_reclaimable_blocks, m.num_empty_blocks) == (3, 0, 7)
    assert m.usage == pytest.approx(0.3)
    m.free(r)
    assert (m.num_active_blocks, m.num_reclaimable_blocks, m.num_empty_blocks) == (0, 2, 8)
    assert m.num_free_blocks == 10


def test_max_concurrent_requests() -> None:
    m = KVCacheManager(1025, 16, 8192)
    assert m.max_blocks_per_req == 512
    assert m.max_concurrent_requests() == 2
    assert m.max_concurrent_requests(1024) == 16
    assert m.max_concurrent_requests(1000) == 16  # cdiv(1000, 16) = 63 -> 1024 // 63
    assert m.max_concurrent_requests(1) == 1024


def test_reset_prefix_cache_refused_while_in_use() -> None:
    m = KVCacheManager(20, 4, 64)
    run_to_completion(m, req("a", list(range(9))))
    busy = req("busy", [1])
    admit(m, busy)
    before = snapshot(m)
    assert m.reset_prefix_cache() is False
    assert snapshot(m) == before
    m.free(busy)
    assert m.reset_prefix_cache() is True
    assert m.num_reclaimable_blocks == 0
    assert m.get_computed_blocks(req("a2", list(range(9))))[1] == 0
    m.check_invariants()


def test_stats_counted_once_per_admission() -> None:
    m = KVCacheManager(6, 4, 64)  # 5 usable
    run_to_completion(m, req("a", list(range(9))))
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (9, 0)
    hog = req("hog", list(range(100, 112)))
    admit(m, hog)  # 3 blocks held; free: 2 reclaimable
    r = req("r", list(range(12)))  # hits 8 tokens, needs 1 more block
    for _ in range(3):  # refused and retried: counted zero times
        blocks, hit = m.get_computed_blocks(r)
        assert hit == 8
        assert m.allocate_slots(r, 4, blocks, hit) is None
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (21, 0)
    m.free(hog)
    blocks, hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, 4, blocks, hit) is not None
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (33, 8)
    r.num_computed_tokens = 12
    m.allocate_slots(r, 0)  # later steps of an admitted request are not admissions
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (33, 8)
    assert m.prefix_cache_hit_rate == pytest.approx(8 / 33)
    # preemption: freed and admitted again counts again (documented)
    m.cache_blocks(r, 12)
    m.free(r)
    r.num_computed_tokens = 0
    admit(m, r)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (45, 16)


def test_hit_rate_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_mod, "STATS_WINDOW", 2)
    m = KVCacheManager(40, 4, 64)
    assert m.prefix_cache_hit_rate == 0.0
    run_to_completion(m, req("a", list(range(9))))  # 0 / 9
    run_to_completion(m, req("b", list(range(9))))  # 8 / 9
    assert m.prefix_cache_hit_rate == pytest.approx(8 / 18)
    run_to_completion(m, req("c", list(range(9))))  # 8 / 9, "a" leaves the window
    assert m.prefix_cache_hit_rate == pytest.approx(16 / 18)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (27, 16)  # cumulative


def test_caching_disabled() -> None:
    m = KVCacheManager(20, 4, 64, enable_caching=False)
    run_to_completion(m, req("a", list(range(9))))
    r = req("b", list(range(9)))
    assert m.get_computed_blocks(r) == (KVCacheBlocks(), 0)
    admit(m, r)
    assert m.num_reclaimable_blocks == 0 and not m.block_pool.cached
    assert m.prefix_cache_queries == 0 and m.prefix_cache_hit_rate == 0.0
    m.free(r)
    assert m.num_empty_blocks == 19


def test_builtin_hash_algo_works_end_to_end() -> None:
    m = KVCacheManager(40, 4, 64, hash_algo="builtin")
    run_to_completion(m, req("a", list(range(9))))
    assert m.get_computed_blocks(req("b", list(range(9))))[1] == 8


def test_check_invariants_catches_a_leaked_reference() -> None:
    m = KVCacheManager(20, 4, 64)
    r = req("r", list(range(9)))
    admit(m, r)
    m.req_to_blocks["r"][0].ref_cnt += 1  # a reference nobody holds
    with pytest.raises(RuntimeError, match="ref_cnt 2 but 1 holders"):
        m.check_invariants()
