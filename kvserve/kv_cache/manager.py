"""KVCacheManager: the scheduler's only KV API.

A request's blocks cover its token positions in order; block ``i`` holds positions
``[i*B, (i+1)*B)`` (B = block_size). One scheduling step for a request looks like::

    all_token_ids:  [ cached prefix (hit) | computed | new this step | not yet ]
                      ^ get_computed_blocks  ^ num_computed_tokens
    blocks needed:  cdiv(num_computed + num_new_computed + num_new_tokens, B)

Scheduler protocol (what a caller must keep):

1. Admitting a waiting request: ``blocks, n = get_computed_blocks(req)`` then, right
   away and with no other allocation in between, ``allocate_slots(req, num_new_tokens,
   blocks, n)``. ``None`` means "does not fit": nothing changed, try later. On success
   the scheduler sets ``req.num_computed_tokens += n``.
2. A running request: ``allocate_slots(req, num_new_tokens)`` each step.
3. After the step's tokens have KV: ``cache_blocks(req, req.num_computed_tokens)``.
4. Finished, aborted or preempted: ``free(req)`` (preemption also resets
   ``num_computed_tokens`` to 0; the request is then admitted again from step 1).
5. Samples of one request: once the leader's prompt has KV, ``fork(leader, sample,
   num_prompt_tokens)`` gives a sample the prompt's blocks (full ones shared, ref
   count up; the partial last one copied into a new block, copy on write) and
   returns the (src, dst) copies the model runner makes before the next forward.

With a KV tier below RAM (``kv_tier``, :mod:`kvserve.kv_cache.tier`; the disk tier of
``kvserve.kv_offload``), full blocks are saved to it when first cached and when
evicted, and ``get_computed_blocks`` goes on past the first RAM miss with the
blocks the tier holds::

    block hashes:  [ RAM hit | RAM hit | tier | tier | RAM hit | tier | miss ...
                     ^ returned as the prefix hit .........................^
    a tier block is loaded into a fresh block, which is then cached (reclaimable,
    ref_cnt 0) exactly as if it had been computed: allocate_slots claims it as a hit.

Prefix-cache stats count a request once per admission (the first successful
``allocate_slots`` since it held no blocks): a refused and retried lookup is not
counted twice, but a preempted request that is admitted again is counted again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvserve.config import HashAlgo, check_int
from kvserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvserve.kv_cache.blocks import EMPTY, KVCacheBlocks
from kvserve.kv_cache.hashing import (
    HASH_ALGOS,
    BlockHash,
    extend_block_hashes,
    request_extra_keys,
)
from kvserve.kv_cache.tier import KVTier
from kvserve.request import Request

STATS_WINDOW = 1000  # admissions in the recent hit-rate window


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Paged KV cache with block-level prefix caching.

    ``num_blocks`` counts the null block 0, so ``num_blocks - 1`` blocks are usable.
    ``model_fingerprint`` (see :func:`kvserve.kv_cache.hashing.model_fingerprint`) goes
    into every request's first block hash, so two models never share blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        hash_algo: HashAlgo = "sha256",
        model_fingerprint: str = "",
        kv_tier: KVTier | None = None,
    ) -> None:
        check_int("num_blocks", num_blocks, "num_blocks=1024")
        check_int("block_size", block_size, "block_size=16")
        check_int("max_model_len", max_model_len, "max_model_len=8192")
        if hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"invalid hash_algo={hash_algo!r}: must be one of {HASH_ALGOS} (for example: hash_algo='sha256')"
            )
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_req = cdiv(max_model_len, block_size)
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.model_fingerprint = model_fingerprint
        # req_id -> blocks held, in position order. A key exists iff the request is admitted.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> how many leading blocks cache_blocks has already processed.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._window: deque[tuple[int, int]] = deque()
        self._window_queries = 0
        self._window_hits = 0
        self.kv_tier = kv_tier if enable_caching else None
        if self.kv_tier is not None:
            self.block_pool.on_evict = self.kv_tier.save

    # -- sizes and counts ---------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_active_blocks(self) -> int:
        return self.block_pool.num_active_blocks

    @property
    def num_reclaimable_blocks(self) -> int:
        return self.block_pool.num_reclaimable_blocks

    @property
    def num_empty_blocks(self) -> int:
        return self.block_pool.num_empty_blocks

    @property
    def num_free_blocks(self) -> int:
        """Reclaimable + empty (each block counted once)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks that are active, in [0, 1]."""
        return self.block_pool.num_active_blocks / self.block_pool.num_usable_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens over the last ``STATS_WINDOW`` admissions; 0.0 when empty."""
        return self._window_hits / self._window_queries if self._window_queries else 0.0

    def max_concurrent_requests(self, max_model_len: int | None = None) -> int:
        """How many requests fit at once if each grows to ``max_model_len`` tokens."""
        length = self.max_model_len if max_model_len is None else max_model_len
        check_int("max_model_len", length, "max_model_len=8192")
        return self.block_pool.num_usable_blocks // cdiv(length, self.block_size)

    # -- hashing ------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> list[BlockHash]:
        """Extend ``request.block_hashes`` to cover every full block of its tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        num_full = len(tokens) // bs
        i = len(hashes)
        if i >= num_full:
            return hashes
        extra = request_extra_keys(self.model_fingerprint, request.adapter_id, request.cache_salt)
        extend_block_hashes(hashes, tokens, bs, extra, self.hash_algo)
        return hashes

    def cached_block_hashes(self) -> list[BlockHash]:
        """The hashes of every block the prefix cache holds now (held or reclaimable).

        One copy of the pool's hash map, which is atomic under CPython's GIL, so
        another thread may call this while the engine thread steps (the scale-out
        replica reports it to the router; ``kvserve.cluster``)."""
        return list(self.block_pool.cached.copy())

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The chained hashes of every full block of ``request.all_token_ids``
        (extends ``request.block_hashes``; stable across processes with sha256)."""
        return self._update_block_hashes(request)

    # -- the scheduler API ----------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest run of cached full blocks from the start of ``request.all_token_ids``.

        Stops at the first miss; a hit is confirmed by the block's token ids. At
        least one token is always left to compute (for the logits): the hit covers at
        most ``num_tokens - 1`` tokens, rounded down to a whole block. Returns the
        blocks and the number of hit tokens (``len(blocks) * block_size``); ``(EMPTY, 0)``
        when caching is off, and for a request that wants prompt logprobs (every prompt
        position needs its logits, so it computes the whole prompt, as vLLM does).
        Changes no ref counts and no stats; extends ``request.block_hashes``.

        With a ``kv_tier``, blocks past the first RAM miss that the tier holds are
        loaded into free blocks (module doc), which may evict other cached blocks
        (saved to the tier first); a block that fails to load ends the hit there and
        goes back to the pool empty. Every block stays accounted for: afterwards the
        loaded blocks are reclaimable cached blocks and all ref counts are as before.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return EMPTY, 0
        hashes = self._update_block_hashes(request)
        bs = self.block_size
        tokens = request.all_token_ids
        max_hit_blocks = min((request.num_tokens - 1) // bs, len(hashes))
        pool = self.block_pool
        hits: list[KVCacheBlock] = []
        for i in range(max_hit_blocks):
            block = pool.get_cached_block(hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        if self.kv_tier is not None and len(hits) < max_hit_blocks:
            hits = self._extend_from_tier(hashes, tokens, hits, max_hit_blocks)
        return KVCacheBlocks(tuple(hits)), len(hits) * bs

    def _extend_from_tier(
        self,
        hashes: list[BlockHash],
        tokens: Sequence[int],
        hits: list[KVCacheBlock],
        max_hit_blocks: int,
    ) -> list[KVCacheBlock]:
        """``hits`` (the RAM prefix hit, ending at a miss) extended with the next
        blocks found in RAM or in the tier, the tier's loaded into fresh blocks."""
        tier = self.kv_tier
        assert tier is not None
        pool = self.block_pool
        bs = self.block_size
        chain = list(hits)
        loads: list[tuple[BlockHash, tuple[int, ...], int]] = []
        load_pos: list[int] = []  # where each load sits in chain
        end = len(chain)
        pool.touch(chain)  # held while loading, so allocating cannot evict them
        try:
            for i in range(len(chain), max_hit_blocks):
                block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
                block = pool.get_cached_block(hashes[i], block_tokens)
                if block is not None:
                    pool.touch([block])
                    chain.append(block)
                    continue
                if pool.num_free_blocks == 0 or not tier.contains(hashes[i]):
                    break
                (new,) = pool.get_new_blocks(1, chain[-1] if chain else None)
                load_pos.append(len(chain))
                loads.append((hashes[i], block_tokens, new.block_id))
                chain.append(new)
            end = len(chain)
            num_loaded = tier.load(loads) if loads else 0
            for j, (block_hash, block_tokens, _) in enumerate(loads):
                pos = load_pos[j]
                if j >= num_loaded or not pool.cache_block(chain[pos], block_hash, block_tokens):
                    end = pos  # the hit ends before the first block that did not load
                    break
        finally:
            # Ref counts as before, tail evicted first; loaded blocks that were not
            # cached (at and after a failed load) go back to the pool empty.
            pool.free_blocks(reversed(chain))
        return chain[:end]

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Claims the prefix-hit blocks (ref up; out of the free queue if free) and
        allocates ``cdiv(num_computed + num_new_computed + num_new_tokens, B)`` minus
        the blocks held, only what is needed now. Returns the newly allocated blocks
        (possibly empty; never the hit blocks). Returns None and changes NOTHING (ref
        counts, free queue, stats) when they do not fit; free cached blocks count as
        available, the hit blocks themselves do not. Check the result with ``is None``.

        Raises ValueError when the call breaks the protocol: negative counts, hit
        blocks that don't match ``num_new_computed_tokens``, hit blocks passed for a
        request that already holds blocks, stale hit blocks (evicted since the lookup),
        or more than ``max_model_len`` tokens.
        """
        hits = list(new_computed_blocks or ())
        bs = self.block_size
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(
                f"allocate_slots for {request.req_id!r}: num_new_tokens={num_new_tokens} and "
                f"num_new_computed_tokens={num_new_computed_tokens} must be >= 0"
            )
        if num_new_computed_tokens != len(hits) * bs:
            raise ValueError(
                f"allocate_slots for {request.req_id!r}: num_new_computed_tokens="
                f"{num_new_computed_tokens} must equal len(new_computed_blocks) * block_size = "
                f"{len(hits) * bs}; pass both values returned by get_computed_blocks"
            )
        held = self.req_to_blocks.get(request.req_id)
        if hits:
            if held or request.num_computed_tokens:
                raise ValueError(
                    f"allocate_slots for {request.req_id!r}: prefix-hit blocks can only be "
                    "claimed on admission (no blocks held, num_computed_tokens == 0)"
                )
            hashes = request.block_hashes
            for i, block in enumerate(hits):
                if i >= len(hashes) or block.block_hash != hashes[i]:
                    raise ValueError(
                        f"allocate_slots for {request.req_id!r}: hit block {block.block_id} "
                        "was evicted since get_computed_blocks; call get_computed_blocks "
                        "right before allocate_slots"
                    )
        num_held = len(held) if held else 0
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if total_tokens > self.max_model_len:
            raise ValueError(
                f"allocate_slots for {request.req_id!r}: {total_tokens} tokens exceed "
                f"max_model_len={self.max_model_len}; schedule at most "
                f"{max(0, self.max_model_len - request.num_computed_tokens - num_new_computed_tokens)} new tokens"
            )
        num_new_blocks = max(0, cdiv(total_tokens, bs) - num_held - len(hits))
        pool = self.block_pool
        num_hits_in_free_queue = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > pool.num_free_blocks - num_hits_in_free_queue:
            return None

        # Everything fits: from here on, mutate.
        if held is None:
            held = self.req_to_blocks[request.req_id] = []
            self.num_cached_blocks[request.req_id] = len(hits)
            if self.enable_caching:
                self._record_admission(request.num_tokens, num_new_computed_tokens)
        if hits:
            pool.touch(hits)
            held.extend(hits)
        new_blocks = pool.get_new_blocks(num_new_blocks, held[-1] if held else None)
        held.extend(new_blocks)
        return KVCacheBlocks(tuple(new_blocks))

    def fork(
        self, parent: Request, child: Request, num_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Give ``child`` (holding no blocks) the KV of ``parent``'s first ``num_tokens``
        tokens, which must be computed::

            parent blocks: [ full | full | partial ]      num_tokens = 2*B + r, 0 < r < B
            child blocks:  [ full | full | copy    ]      full ones shared (ref_cnt + 1),
                                                          the partial one copied to a new block

        Returns the ``(src, dst)`` block copies the model runner must make before the
        child's next step (empty when ``num_tokens`` is a multiple of the block size), or
        None, changing nothing, when no block is free for the copy. The child's
        ``num_computed_tokens`` is the caller's to set.
        """
        if child.req_id in self.req_to_blocks:
            raise ValueError(f"fork: {child.req_id!r} already holds blocks")
        bs = self.block_size
        blocks = self.req_to_blocks.get(parent.req_id, [])
        num_full, rest = divmod(num_tokens, bs)
        if len(blocks) < num_full + (rest > 0):
            raise ValueError(
                f"fork: {parent.req_id!r} holds {len(blocks)} blocks, fewer than its "
                f"{num_tokens} computed tokens need"
            )
        pool = self.block_pool
        if rest and pool.num_free_blocks < 1:
            return None
        shared = blocks[:num_full]
        pool.touch(shared)
        held = list(shared)
        copies: list[tuple[int, int]] = []
        if rest:
            (new,) = pool.get_new_blocks(1, shared[-1] if shared else None)
            held.append(new)
            copies.append((blocks[num_full].block_id, new.block_id))
        self.req_to_blocks[child.req_id] = held
        self.num_cached_blocks[child.req_id] = min(
            self.num_cached_blocks.get(parent.req_id, 0), num_full
        )
        child.block_hashes = list(parent.block_hashes[:num_full])
        return copies

    def _record_admission(self, queries: int, hits: int) -> None:
        self.prefix_cache_queries += queries
        self.prefix_cache_hits += hits
        self._window.append((queries, hits))
        self._window_queries += queries
        self._window_hits += hits
        if len(self._window) > STATS_WINDOW:
            q, h = self._window.popleft()
            self._window_queries -= q
            self._window_hits -= h

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Hash and cache every block of ``request`` that is full within the first
        ``num_computed_tokens`` tokens and not cached yet. Partial blocks are never
        cached. When another block already holds the same content (two requests
        computed it at once), the existing cached block is kept and this one stays
        uncached (it is reused first once freed). No-op when caching is off.
        """
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.req_id)
        if blocks is None:
            return
        if num_computed_tokens > request.num_tokens:
            raise ValueError(
                f"cache_blocks for {request.req_id!r}: num_computed_tokens={num_computed_tokens} "
                f"exceeds the request's {request.num_tokens} tokens"
            )
        bs = self.block_size
        start = self.num_cached_blocks[request.req_id]
        end = min(num_computed_tokens // bs, len(blocks))
        if end <= start:
            return
        hashes = self._update_block_hashes(request)
        tokens = request.all_token_ids
        pool = self.block_pool
        saved: list[tuple[BlockHash, tuple[int, ...], int]] = []
        for i in range(start, end):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            if pool.cache_block(blocks[i], hashes[i], block_tokens) and self.kv_tier is not None:
                saved.append((hashes[i], block_tokens, blocks[i].block_id))
        self.num_cached_blocks[request.req_id] = end
        if saved and self.kv_tier is not None:
            self.kv_tier.save(saved)  # written through, so the blocks outlive a restart

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first. Cached blocks stay reclaimable
        (evicted least recently freed first); uncached ones are reused first.
        A request that holds nothing is ignored."""
        blocks = self.req_to_blocks.pop(request.req_id, None)
        self.num_cached_blocks.pop(request.req_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the request's blocks past the first ``cdiv(num_tokens, B)`` (speculative
        decoding: blocks that held only rejected draft tokens), tail first; returns
        how many were freed. Blocks below are kept, cached ones stay cached."""
        blocks = self.req_to_blocks.get(request.req_id)
        if not blocks:
            return 0
        keep = cdiv(max(0, num_tokens), self.block_size)
        if keep >= len(blocks):
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        self.num_cached_blocks[request.req_id] = min(self.num_cached_blocks[request.req_id], keep)
        self.block_pool.free_blocks(reversed(tail))
        return len(tail)

    def holds_blocks(self, req_id: str) -> bool:
        """Whether ``req_id`` holds blocks now (admitted, parked for remote KV or
        forked, and not freed since)."""
        return req_id in self.req_to_blocks

    def num_held_blocks(self, req_id: str) -> int:
        """How many blocks ``req_id`` holds (0 when none)."""
        return len(self.req_to_blocks.get(req_id, ()))

    def get_block_ids(self, req_id: str) -> list[int]:
        """Block ids held by the request, in position order ([] if none)."""
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks. Returns False and changes nothing while any
        block is active; True once reset."""
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise RuntimeError describing the first broken invariant, if any."""
        pool = self.block_pool
        pool.check_invariants()
        total = self.num_active_blocks + self.num_reclaimable_blocks + self.num_empty_blocks
        if total != self.num_blocks - 1:
            raise RuntimeError(
                f"active + reclaimable + empty = {total} != num_blocks - 1 = {self.num_blocks - 1}"
            )
        holders: dict[int, list[str]] = {}
        for req_id, blocks in self.req_to_blocks.items():
            if len(blocks) > self.max_blocks_per_req:
                raise RuntimeError(
                    f"request {req_id!r} holds {len(blocks)} > max_blocks_per_req blocks"
                )
            if self.num_cached_blocks.get(req_id, -1) > len(blocks):
                raise RuntimeError(f"request {req_id!r} has more cached blocks than blocks")
            for block in blocks:
                holders.setdefault(block.block_id, []).append(req_id)
        if set(self.num_cached_blocks) != set(self.req_to_blocks):
            raise RuntimeError("num_cached_blocks and req_to_blocks track different requests")
        for block in pool.blocks:
            owners = holders.get(block.block_id, [])
            if block.ref_cnt != len(owners):
                raise RuntimeError(
                    f"{block} has ref_cnt {block.ref_cnt} but {len(owners)} holders {owners}"
                )
            if len(set(owners)) != len(owners):
                raise RuntimeError(f"{block} is held twice by request {owners}")
            # A shared block is a prefix-cache hit or a prompt block shared by the
            # samples of one request (fork); the latter need not be cached.
