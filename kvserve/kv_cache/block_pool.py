"""The fixed pool of KV blocks: ref counts, the free queue, the prefix-cache map.

Every usable block is in exactly one of three buckets::

    active       ref_cnt > 0                    held by at least one request
    reclaimable  ref_cnt == 0, block_hash set   cached content, in the free queue
    empty        ref_cnt == 0, no block_hash    no valid content, in the free queue

    num_active + num_reclaimable + num_empty == num_blocks - 1   (block 0 is the null block)

The free queue holds reclaimable and empty blocks together (``num_free_blocks``
counts both once; never add ``num_reclaimable`` to it again). Its order is the
eviction order::

    front ─▶ [empty blocks ...][cached blocks, least recently freed first ...] ◀─ back

Blocks without a hash are put at the front when freed, so they are reused before any
cached block; cached blocks go to the back, and a request frees its blocks tail
first, so the end of a chain is evicted before its start. Popping a cached block to
reuse it evicts it: its hash leaves the cache map.

Allocation order (contiguity: the decode kernel streams a run of consecutive block
ids as one piece of memory per KV head, see kvserve/model/kv_cache_tensor.py):

1. Empty blocks are always taken before any cached block (as above), but WHICH empty
   block is the pool's choice, so it keeps each request's blocks in runs of
   consecutive ids. The empty blocks are indexed as maximal runs of consecutive ids
   (``_run_end``/``_run_start``, and a lazy max-heap by length). For the block after
   ``after`` (the request's current last block): id ``after + 1`` when that block is
   empty; otherwise a new run, at the start of the longest empty run, or at its middle
   when the block before that run is held (some request may be growing into it: it
   keeps half the gap). Cost: O(1) for ``after + 1``, O(log runs) for a new run or a
   freed block (heap push).
2. Cached blocks are evicted strictly in free-queue (LRU) order, never out of order
   for contiguity: an allocation of ``n`` blocks evicts exactly the ``n - empty``
   front ones it evicted before, and only hands them out sorted by id (a chain freed
   tail first is then handed out ascending again).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

from kvserve.config import check_int
from kvserve.kv_cache.hashing import BlockHash


class KVCacheBlock:
    """Metadata of one KV block (the KV tensors live in the model runner).

    ``block_hash``/``token_ids`` are set while the block holds a full, cached block
    and cleared when it is evicted. ``prev_free``/``next_free`` link the block into
    the :class:`FreeBlockQueue`; they are None while the block is not in the queue.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves.

    ``popleft``, ``append``, ``appendleft`` and ``remove`` (from anywhere, e.g. a cache
    hit on a free cached block) are all O(1). A block is in the queue iff its
    ``prev_free`` is not None (the sentinels guarantee every member has neighbours).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)  # sentinel before the front
        self._tail = KVCacheBlock(-1)  # sentinel after the back
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def _insert_between(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        block.prev_free = prev
        block.next_free = nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        prev = self._tail.prev_free
        assert prev is not None
        self._insert_between(block, prev, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the front (reused first)."""
        nxt = self._head.next_free
        assert nxt is not None
        self._insert_between(block, self._head, nxt)

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the queue, wherever it is. It must be in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block. Raises IndexError when empty."""
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("pop from an empty free block queue")
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Front to back."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """``num_blocks`` blocks (block 0 = null block, never handed out), ref counts,
    the free queue and the hash -> block map of cached blocks.

    At most one block is cached per hash. With ``enable_caching=False`` nothing is
    ever cached and every free block is empty.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        check_int(
            "num_blocks",
            num_blocks,
            "num_blocks=1024",
            minimum=2,
            why=" (block 0 is the null block)",
        )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self._num_reclaimable = 0
        # Called once per allocation that evicts cached blocks, with (hash, token ids,
        # block id) of each, after they left the cache and before the caller gets them
        # (the KV offload tier copies their KV out here; kvserve.kv_cache.tier). It must
        # not raise and must not call back into the pool.
        self.on_evict: Callable[[list[tuple[BlockHash, tuple[int, ...], int]]], None] | None = None
        # The empty blocks as maximal runs of consecutive ids (see the module doc):
        # start -> end and end -> start (inclusive), and a max-heap of (-length, end).
        # A run that shrinks from its start (the common case: a request growing into
        # it) keeps its entry, whose length is then too large: corrected when it
        # reaches the top. Every run has an entry with at least its length; entries
        # of runs that are gone, or longer than their run, are dropped at the top.
        self._run_end: dict[int, int] = {1: num_blocks - 1}
        self._run_start: dict[int, int] = {num_blocks - 1: 1}
        self._run_heap: list[tuple[int, int]] = [(-(num_blocks - 1), num_blocks - 1)]

    # -- counts -----------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Reclaimable + empty: how many blocks an allocation may take right now."""
        return self.free_queue.num_free_blocks

    @property
    def num_reclaimable_blocks(self) -> int:
        return self._num_reclaimable

    @property
    def num_empty_blocks(self) -> int:
        return self.free_queue.num_free_blocks - self._num_reclaimable

    @property
    def num_active_blocks(self) -> int:
        return self.num_blocks - 1 - self.free_queue.num_free_blocks

    # -- cache lookups ------------------------------------------------------------
    def get_cached_block(
        self, block_hash: BlockHash, token_ids: tuple[int, ...]
    ) -> KVCacheBlock | None:
        """The cached block with this hash, confirmed by its token ids; None on a miss."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def cache_block(
        self, block: KVCacheBlock, block_hash: BlockHash, token_ids: tuple[int, ...]
    ) -> bool:
        """Mark a held, full, uncached block as cached under ``block_hash``.

        Returns False (and leaves ``block`` uncached) when another block is already
        cached under that hash: the existing one is kept so hits keep going to it.
        """
        if block.ref_cnt <= 0 or block.is_null:
            raise RuntimeError(f"only a held block can be cached, got {block}")
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if not self.enable_caching or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block
        return True

    # -- allocation -------------------------------------------------------------
    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block, taking free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if block.is_null:
                    raise RuntimeError("the null block cannot be held")
                if block.block_hash is not None:
                    self._num_reclaimable -= 1
                else:
                    self._remove_empty(block.block_id)
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(
        self, num_blocks: int, after: KVCacheBlock | None = None
    ) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks, ref_cnt 1 each, in the order the request
        will use them (``after``: the block they follow in its table, None when they
        start it). Empty blocks first, chosen for contiguity; then cached blocks in
        LRU order, each evicted (its hash leaves the map), handed out sorted by id
        (see the module doc). The caller must have checked ``num_free_blocks`` first;
        asking for more raises RuntimeError.
        """
        if num_blocks > self.free_queue.num_free_blocks:
            raise RuntimeError(
                f"cannot allocate {num_blocks} blocks: only {self.free_queue.num_free_blocks} free"
            )
        out = []
        prev = after
        num_empty = min(num_blocks, self.num_empty_blocks)
        for _ in range(num_empty):
            block = self._take_empty(prev)
            block.ref_cnt = 1
            out.append(block)
            prev = block
        evicted = []
        gone: list[tuple[BlockHash, tuple[int, ...], int]] = []
        for _ in range(num_blocks - num_empty):
            block = self.free_queue.popleft()
            if block.block_hash is None:  # cannot happen: the empty ones are taken above
                raise RuntimeError(f"empty {block} behind the cached blocks in the free queue")
            if self.on_evict is not None and block.token_ids is not None:
                gone.append((block.block_hash, block.token_ids, block.block_id))
            self._evict(block)
            block.ref_cnt = 1
            evicted.append(block)
        evicted.sort(key=lambda b: b.block_id)
        out.extend(evicted)
        if gone and self.on_evict is not None:
            self.on_evict(gone)
        return out

    # -- the index of empty runs ------------------------------------------------------
    def _is_empty(self, block_id: int) -> bool:
        """Whether ``block_id`` is a real block that is free and holds no cached content."""
        if block_id <= 0 or block_id >= self.num_blocks:
            return False
        b = self.blocks[block_id]
        return b.ref_cnt == 0 and b.block_hash is None and b.prev_free is not None

    def _set_run(self, start: int, end: int) -> None:
        self._run_end[start] = end
        self._run_start[end] = start
        heapq.heappush(self._run_heap, (start - end - 1, end))
        if len(self._run_heap) > 2 * len(self._run_end) + 64:  # drop the stale entries
            self._run_heap = [(s - e - 1, e) for s, e in self._run_end.items()]
            heapq.heapify(self._run_heap)

    def _add_empty(self, block_id: int) -> None:
        """Index ``block_id``, which just became empty, merging it with its neighbours' runs."""
        start = end = block_id
        if self._is_empty(block_id - 1):
            start = self._run_start.pop(block_id - 1)
            del self._run_end[start]
        if self._is_empty(block_id + 1):
            end = self._run_end.pop(block_id + 1)
            del self._run_start[end]
        self._set_run(start, end)

    def _remove_empty(self, block_id: int, start: int | None = None) -> None:
        """Take ``block_id`` out of its run (``start``: the run's first id, when known;
        otherwise found by walking left, which only a hit on an empty block needs)."""
        if start is None:
            start = block_id
            while start not in self._run_end:
                start -= 1
        end = self._run_end.pop(start)
        if block_id == start and block_id < end:  # shrinks from its start: no heap push
            self._run_end[start + 1] = end
            self._run_start[end] = start + 1
            return
        del self._run_start[end]
        if start < block_id:
            self._set_run(start, block_id - 1)
        if block_id < end:
            self._set_run(block_id + 1, end)

    def _take_empty(self, after: KVCacheBlock | None) -> KVCacheBlock:
        """Remove and return the empty block that should follow ``after`` (module doc)."""
        if after is not None and after.block_id + 1 in self._run_end:
            block_id, start = after.block_id + 1, after.block_id + 1  # a run starts there
        else:
            heap = self._run_heap
            while True:
                neg_len, end = heap[0]
                run_start = self._run_start.get(end)
                if run_start is not None and end - run_start + 1 == -neg_len:
                    start = run_start
                    break
                heapq.heappop(heap)
                if run_start is not None and end - run_start + 1 < -neg_len:  # shrunk
                    heapq.heappush(heap, (run_start - end - 1, end))
            block_id = start
            if start > 1 and self.blocks[start - 1].ref_cnt > 0:
                block_id = start + (end - start + 1) // 2
        self._remove_empty(block_id, start)
        block = self.blocks[block_id]
        self.free_queue.remove(block)
        return block

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self._num_reclaimable -= 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order (eviction order).

        Blocks reaching ref_cnt 0 join the free queue: cached ones at the back,
        uncached ones at the front.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                    self._add_empty(block.block_id)
                else:
                    self.free_queue.append(block)
                    self._num_reclaimable += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False, nothing changed) while any block
        is active, because a held block's hash may be shared by a later hit."""
        if self.num_active_blocks > 0:
            return False
        for block in self.cached.values():
            block.block_hash = None
            block.token_ids = None
            if block.prev_free is not None:  # free (every block is, here): now empty
                self._add_empty(block.block_id)
        self.cached.clear()
        self._num_reclaimable = 0
        return True

    def check_invariants(self) -> None:
        """Raise RuntimeError naming the first broken pool invariant."""

        def fail(msg: str) -> None:
            raise RuntimeError(f"block pool invariant broken: {msg}")

        null = self.null_block
        if null.ref_cnt != 0 or null in self.free_queue or null.block_hash is not None:
            fail(f"null block is in use: {null}")
        seen: set[int] = set()
        prev = self.free_queue._head
        for block in self.free_queue:
            if block.prev_free is not prev:
                fail(f"broken back link at {block}")
            prev = block
            if block.block_id in seen:
                fail(f"{block} appears twice in the free queue")
            seen.add(block.block_id)
            if block.ref_cnt != 0:
                fail(f"{block} is in the free queue with ref_cnt {block.ref_cnt}")
        if len(seen) != self.free_queue.num_free_blocks:
            fail(
                f"free queue holds {len(seen)} blocks but counts {self.free_queue.num_free_blocks}"
            )
        num_reclaimable = 0
        for block in self.blocks[1:]:
            in_queue = block.block_id in seen
            if block.ref_cnt < 0:
                fail(f"{block} has a negative ref_cnt")
            if (block.ref_cnt == 0) != in_queue:
                fail(f"{block} free-queue membership disagrees with ref_cnt")
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is not block:
                    fail(f"{block} has a hash but is not the cached block for it")
                if block.token_ids is None:
                    fail(f"{block} is cached without token ids")
                if in_queue:
                    num_reclaimable += 1
            elif block.token_ids is not None:
                fail(f"{block} has token ids but no hash")
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                fail(f"cache map entry points to {block} with a different hash")
        if num_reclaimable != self._num_reclaimable:
            fail(f"reclaimable count {self._num_reclaimable} != actual {num_reclaimable}")
        if not self.enable_caching and self.cached:
            fail("blocks are cached while caching is disabled")
        indexed = 0
        heap_len: dict[int, int] = {}
        for neg_len, e in self._run_heap:
            heap_len[e] = max(heap_len.get(e, 0), -neg_len)
        for start, end in self._run_end.items():
            if self._run_start.get(end) != start or end < start:
                fail(f"empty run [{start}, {end}] has inconsistent ends")
            if self._is_empty(start - 1) or self._is_empty(end + 1):
                fail(f"empty run [{start}, {end}] is not maximal")
            for i in range(start, end + 1):
                if not self._is_empty(i):
                    fail(f"block {i} is indexed in an empty run but is not empty")
            if heap_len.get(end, 0) < end - start + 1:
                fail(f"empty run [{start}, {end}] is missing from the heap")
            indexed += end - start + 1
        if len(self._run_start) != len(self._run_end):
            fail("the empty runs' start and end maps disagree")
        if indexed != self.num_empty_blocks:
            fail(f"{indexed} blocks indexed in empty runs but {self.num_empty_blocks} are empty")
