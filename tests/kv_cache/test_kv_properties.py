"""Property tests: random interleavings of lookup / allocate / append / cache / free.

A small pool (so eviction and refusals happen often) and prompts built from a few
shared prefixes over a 4-token alphabet (so hits and duplicate content happen often).
Besides the manager's own ``check_invariants``, the machine keeps an independent model:

- which requests are admitted and what they hold (read through the public API), to
  check ref counts == holders, the three counts, and that only cached blocks are shared;
- a shadow "KV content" per block slot: the (salt, token prefix) whose KV was written
  there. Every prefix hit must return blocks whose content is exactly what the request
  would have computed itself, and a write must never land in a block someone else holds
  or in a cached block.

Speculative decoding (rule ``speculate``): a decode computes its token plus random
drafts, a random prefix of them is accepted (the real rollback of
``kvserve.sched.spec``), and the shadow content of rejected positions is
what the drafts wrote: a prefix hit must never return a block holding a rejected
draft's KV, and blocks holding only rejected drafts must be gone (every request holds
exactly ``cdiv(num_computed_tokens, B)`` blocks).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.kv_cache import KVCacheBlock, KVCacheManager, cdiv
from kvserve.request import Request, SamplingParams
from kvserve.sched import spec as spec
from kvserve.sched.spec_stats import SpecDecodingStats

BLOCK_SIZE = 4
NUM_BLOCKS = 16  # 15 usable: a few requests of up to 12 blocks fill it
MAX_MODEL_LEN = 48
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9], [5] * 13]
SP = SamplingParams()


class KVMachine(RuleBasedStateMachine):
    @initialize(caching=st.booleans(), algo=st.sampled_from(["sha256", "builtin"]))
    def setup(self, caching: bool, algo: str) -> None:
        self.m = KVCacheManager(
            NUM_BLOCKS,
            BLOCK_SIZE,
            MAX_MODEL_LEN,
            enable_caching=caching,
            hash_algo=algo,
            model_fingerprint="fp",
        )
        self.waiting: dict[str, Request] = {}
        self.admitted: dict[str, Request] = {}
        # block_id -> slot -> identity of the KV written there
        self.content: dict[int, dict[int, tuple]] = {}
        self.counter = 0

    # -- helpers --------------------------------------------------------------------
    @staticmethod
    def identity(r: Request, pos: int) -> tuple:
        return (r.cache_salt, tuple(r.all_token_ids[: pos + 1]))

    @staticmethod
    def _pick(data: st.DataObject, pool: dict[str, Request]) -> Request | None:
        """Draw one of ``pool`` (None when it is empty: the rule does nothing)."""
        if not pool:
            return None
        return data.draw(st.sampled_from(sorted(pool.values(), key=lambda x: x.req_id)))

    def _compute(self, r: Request, new_blocks: list[KVCacheBlock], end: int) -> None:
        """Pretend the model wrote KV for positions [num_computed, end), then cache."""
        for blk in new_blocks:  # a freshly allocated block holds no valid KV
            self.content.pop(blk.block_id, None)
        blocks = self.m.req_to_blocks[r.req_id]
        for pos in range(r.num_computed_tokens, end):
            blk = blocks[pos // BLOCK_SIZE]
            assert blk.ref_cnt == 1, f"writing into {blk} that another request holds"
            assert blk.block_hash is None, f"writing into cached {blk}"
            self.content.setdefault(blk.block_id, {})[pos % BLOCK_SIZE] = self.identity(r, pos)
        r.num_computed_tokens = end
        self.m.cache_blocks(r, end)

    def _admit(self, r: Request, chunk: int) -> bool:
        m = self.m
        before = (m.num_free_blocks, m.prefix_cache_queries, m.prefix_cache_hits)
        blocks, hit = m.get_computed_blocks(r)
        assert hit == len(blocks) * BLOCK_SIZE and hit <= r.num_tokens - 1
        assert hit % BLOCK_SIZE == 0
        for i, blk in enumerate(blocks):  # a hit must carry exactly this request's KV
            slots = self.content.get(blk.block_id, {})
            for s in range(BLOCK_SIZE):
                assert slots.get(s) == self.identity(r, i * BLOCK_SIZE + s), f"wrong KV in {blk}"
        assert (m.num_free_blocks, m.prefix_cache_queries, m.prefix_cache_hits) == before
        n = min(chunk, r.num_tokens - hit)
        new = m.allocate_slots(r, n, blocks, hit)
        if new is None:  # refused: nothing changed
            assert r.req_id not in m.req_to_blocks
            assert (m.num_free_blocks, m.prefix_cache_queries, m.prefix_cache_hits) == before
            return False
        if m.enable_caching:  # counted exactly once, at admission
            assert m.prefix_cache_queries == before[1] + r.num_tokens
            assert m.prefix_cache_hits == before[2] + hit
        held = m.get_block_ids(r.req_id)
        assert held[: len(blocks)] == [b.block_id for b in blocks]
        assert len(held) == cdiv(hit + n, BLOCK_SIZE)
        self.admitted[r.req_id] = self.waiting.pop(r.req_id)
        r.num_computed_tokens = hit
        self._compute(r, new, hit + n)
        return True

    def _advance(self, r: Request, chunk: int) -> None:
        remaining = r.num_tokens - r.num_computed_tokens
        if remaining == 0:
            return
        n = min(chunk, remaining)
        held_before = self.m.get_block_ids(r.req_id)
        stats_before = (self.m.prefix_cache_queries, self.m.prefix_cache_hits)
        new = self.m.allocate_slots(r, n)
        assert (self.m.prefix_cache_queries, self.m.prefix_cache_hits) == stats_before
        if new is None:
            assert self.m.get_block_ids(r.req_id) == held_before
            return
        assert len(held_before) + len(new) == cdiv(r.num_computed_tokens + n, BLOCK_SIZE)
        self._compute(r, new, r.num_computed_tokens + n)

    # -- rules --------------------------------------------------------------------------
    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        suffix=st.lists(st.integers(0, 3), max_size=24),
        salt=st.sampled_from([None, None, "t1"]),
    )
    def new_request(self, prefix: int, suffix: list[int], salt: str | None) -> None:
        tokens = (PREFIXES[prefix] + suffix)[: MAX_MODEL_LEN - 4] or [0]
        self.counter += 1
        req_id = f"r{self.counter}"
        self.waiting[req_id] = Request(req_id, tokens, SP, cache_salt=salt)

    @rule(data=st.data(), chunk=st.integers(1, 48))
    def admit(self, data: st.DataObject, chunk: int) -> None:
        r = self._pick(data, self.waiting)
        if r is not None:
            self._admit(r, chunk)

    @rule(data=st.data(), chunk=st.integers(1, 48))
    def step_one(self, data: st.DataObject, chunk: int) -> None:
        r = self._pick(data, self.admitted)
        if r is not None:
            self._advance(r, chunk)

    @rule(chunk=st.integers(1, 16), token=st.integers(0, 3))
    def schedule(self, chunk: int, token: int) -> None:
        """One scheduler-like step: running requests decode (append a token once caught
        up) or prefill a chunk, then waiting requests are admitted while they fit."""
        for r in list(self.admitted.values()):
            if r.num_computed_tokens == r.num_tokens and r.num_tokens < MAX_MODEL_LEN:
                r.append_output_token_ids(token)
            self._advance(r, chunk)
        for r in list(self.waiting.values()):
            if not self._admit(r, chunk):
                break

    @rule(data=st.data(), token=st.integers(0, 3))
    def append_token(self, data: st.DataObject, token: int) -> None:
        """A decode step produced a token (only once the request has caught up)."""
        r = self._pick(data, self.admitted)
        if r is not None and r.num_computed_tokens == r.num_tokens and r.num_tokens < MAX_MODEL_LEN:
            r.append_output_token_ids(token)

    @rule(
        data=st.data(),
        drafts=st.lists(st.integers(0, 3), min_size=1, max_size=9),
        accepted=st.integers(0, 9),
        bonus=st.integers(0, 3),
    )
    def speculate(self, data: st.DataObject, drafts: list[int], accepted: int, bonus: int) -> None:
        """A decode verifies drafts: KV written for the token and every draft, then
        the rejected drafts rolled back and their blocks freed."""
        r = self._pick(data, self.admitted)
        if r is None or r.num_computed_tokens != r.num_tokens - 1:
            return
        c = r.num_computed_tokens
        drafts = drafts[: max(0, MAX_MODEL_LEN - r.num_tokens - 1)]
        if not drafts:
            return
        new = self.m.allocate_slots(r, 1 + len(drafts))
        if new is None:
            return
        for blk in new:
            self.content.pop(blk.block_id, None)
        blocks = self.m.req_to_blocks[r.req_id]
        written = r.all_token_ids + drafts
        for pos in range(c, c + 1 + len(drafts)):
            blk = blocks[pos // BLOCK_SIZE]
            assert blk.ref_cnt == 1 and blk.block_hash is None, f"draft KV into shared {blk}"
            self.content.setdefault(blk.block_id, {})[pos % BLOCK_SIZE] = (
                r.cache_salt,
                tuple(written[: pos + 1]),
            )
        m = min(accepted, len(drafts))
        if m < len(drafts) and bonus == drafts[m]:
            bonus = (bonus + 1) % 4  # a real rejection samples another token
        sampled = drafts[:m] + [bonus]
        r.num_computed_tokens = c + 1 + len(drafts)
        spec.rollback(r, len(drafts), sampled, SpecDecodingStats())
        r.append_output_token_ids(sampled)
        spec.apply_verification(r, self.m, self.m.enable_caching)
        assert r.num_computed_tokens == r.num_tokens - 1 == c + 1 + m

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """Finished, or aborted (a waiting request may be aborted too)."""
        r = self._pick(data, {**self.admitted, **self.waiting})
        if r is None:
            return
        self.m.free(r)
        self.admitted.pop(r.req_id, None)
        self.waiting.pop(r.req_id, None)
        assert self.m.get_block_ids(r.req_id) == []

    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        r = self._pick(data, self.admitted)
        if r is None:
            return
        self.m.free(r)
        del self.admitted[r.req_id]
        r.num_computed_tokens = 0
        self.waiting[r.req_id] = r

    @rule(roll=st.integers(0, 9))
    def reset(self, roll: int) -> None:
        if roll:  # rare: a reset wipes the cache the other rules exercise
            return
        cached_before = dict(self.m.block_pool.cached)
        ok = self.m.reset_prefix_cache()
        assert ok == (self.m.num_active_blocks == 0)
        if ok:
            assert self.m.num_reclaimable_blocks == 0 and not self.m.block_pool.cached
        else:
            assert self.m.block_pool.cached == cached_before

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def invariants_hold(self) -> None:
        m = self.m
        m.check_invariants()
        assert m.num_active_blocks + m.num_reclaimable_blocks + m.num_empty_blocks == NUM_BLOCKS - 1
        assert m.num_free_blocks == m.num_reclaimable_blocks + m.num_empty_blocks
        assert 0.0 <= m.usage <= 1.0
        if not m.enable_caching:
            assert m.num_reclaimable_blocks == 0
        holders: dict[int, list[str]] = {}
        for req_id in self.admitted:
            for bid in m.get_block_ids(req_id):
                holders.setdefault(bid, []).append(req_id)
        assert set(m.req_to_blocks) == set(self.admitted)
        assert 0 not in holders  # the null block is never handed out
        for blk in m.block_pool.blocks:
            owners = holders.get(blk.block_id, [])
            assert blk.ref_cnt == len(owners), f"{blk} held by {owners}"
            if len(owners) > 1:
                assert blk.block_hash is not None, f"{blk} shared by {owners} but not cached"
        assert m.num_active_blocks == len(holders)
        for req_id, r in self.admitted.items():
            ids = m.get_block_ids(req_id)
            assert len(ids) == cdiv(r.num_computed_tokens, BLOCK_SIZE)  # only what is needed now
            assert len(ids) <= m.max_blocks_per_req == MAX_MODEL_LEN // BLOCK_SIZE
            assert all(ids)  # never the null block

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for r in list(self.admitted.values()):
            self.m.free(r)
        self.m.check_invariants()
        assert self.m.num_active_blocks == 0
        assert self.m.num_free_blocks == NUM_BLOCKS - 1
        assert self.m.reset_prefix_cache()
        assert self.m.num_empty_blocks == NUM_BLOCKS - 1


KVMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVMachine = KVMachine.TestCase
