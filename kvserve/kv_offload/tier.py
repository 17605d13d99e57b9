"""The KV offload tier: the paged KV cache's blocks to and from a
:class:`~kvserve.kv_offload.store.DiskKVStore`. It implements the
:class:`~kvserve.kv_cache.tier.KVTier` protocol the KV cache manager calls::

    save(blocks)   engine thread, before the blocks' KV can change: one gather of
                   their K/V out of the cache (index_select over the block dim), then
                   each block queued for the writer thread (serialised and written there)
    load(blocks)   engine thread: each block from the write queue if still queued, else
                   its file read straight into a staging buffer and checked there; then
                   all of them into their cache blocks with one index_copy_ (a strided
                   copy_ per block cost ~16 ms a block here, index_copy_ ~0.15 ms)

The cache is the runner's tensor ``[L, 2, Hk, num_blocks, B, D]``
(:mod:`kvserve.model.kv_cache_tensor`); one block is ``cache[:, :, :, b]``, shape
``[L, 2, Hk, B, D]``. 8-bit KV formats are stored as their raw codes and scales.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from kvserve.kv_cache.hashing import BlockHash
from kvserve.kv_offload.store import BlockLayout, DiskKVStore, OffloadStats

logger = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 256 << 20  # KV waiting for the writer thread, at most


def _to_bytes(block: torch.Tensor) -> np.ndarray:
    """One block's KV as raw bytes (writer thread: the contiguous copy happens here)."""
    return block.contiguous().view(torch.uint8).numpy()


class DiskKVTier:
    """Blocks of ``kv_cache`` offloaded to ``directory`` (at most ``max_bytes`` of files).

    ``fingerprint``: the block-hash salt of this engine's KV (the model and KV format,
    ``EngineCore``'s ``kv_fingerprint``), written into and checked against every file.
    Caller rules: the engine thread only (``stats`` excepted); ``close`` once.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        directory: str | os.PathLike[str],
        max_bytes: int,
        fingerprint: str,
    ) -> None:
        if kv_cache.dim() != 6:
            raise ValueError(
                f"expected a [L, 2, Hk, blocks, B, D] KV cache, got {tuple(kv_cache.shape)}"
            )
        self.kv_cache = kv_cache
        layers, two, heads, _, block_size, dim = kv_cache.shape
        shape = (layers, two, heads, block_size, dim)
        nbytes = layers * two * heads * block_size * dim * kv_cache.element_size()
        self.block_nbytes = nbytes
        self.layout = BlockLayout(
            fingerprint, str(kv_cache.dtype).removeprefix("torch."), shape, nbytes
        )
        self.store = DiskKVStore(
            directory,
            self.layout,
            max_bytes,
            _to_bytes,
            max_queued=max(16, MAX_QUEUED_BYTES // max(1, nbytes)),
        )

    # ------------------------------------------------------------------ KVTier
    def contains(self, block_hash: BlockHash) -> bool:
        return self.store.contains(block_hash)

    def save(self, blocks: Sequence[tuple[BlockHash, tuple[int, ...], int]]) -> None:
        """Copy the KV of ``blocks`` ((hash, token ids, block id) each) out of the cache
        now and queue them for writing; blocks already stored or queued are skipped.
        Never raises: a failure is logged and the blocks are simply not offloaded."""
        try:
            todo = [b for b in blocks if not self.store.contains(b[0])]
            if not todo:
                return
            index = torch.tensor(
                [b[2] for b in todo], dtype=torch.long, device=self.kv_cache.device
            )
            gathered = self.kv_cache.index_select(3, index).cpu()  # [L, 2, Hk, n, B, D]
            for j, (block_hash, token_ids, _) in enumerate(todo):
                self.store.put(block_hash, token_ids, gathered.select(3, j))
        except Exception:
            logger.exception("kv offload: copying %d blocks out of the cache failed", len(blocks))

    def load(self, blocks: Sequence[tuple[BlockHash, tuple[int, ...], int]]) -> int:
        """Write ``blocks`` ((hash, token ids, cache block id) each, in chain order) into
        the cache: each from the write queue if still queued, else its checked file read
        into a staging buffer, then all with one ``index_copy_``. Stops at the first
        block that is not stored or whose file is rejected; returns how many leading
        blocks were written (the cache blocks after them are left as they were). Never
        raises (an error reads as 0)."""
        try:
            n = len(blocks)
            if n == 0:
                return 0
            staging = torch.empty((n, *self.layout.shape), dtype=self.kv_cache.dtype)
            raw = staging.view(n, -1).view(torch.uint8).numpy()  # [n, nbytes], writable
            ok = 0
            for j, (block_hash, token_ids, _) in enumerate(blocks):
                pending = self.store.get_pending(block_hash, token_ids)
                if pending is not None:
                    staging[j].copy_(pending)
                elif not self.store.read_into(block_hash, token_ids, memoryview(raw[j])):
                    break
                ok += 1
            if ok:
                index = torch.tensor(
                    [b[2] for b in blocks[:ok]], dtype=torch.long, device=self.kv_cache.device
                )
                # [ok, L, 2, Hk, B, D] -> the cache's block dim 3
                self.kv_cache.index_copy_(
                    3, index, staging[:ok].movedim(0, 3).to(self.kv_cache.device)
                )
            return ok
        except Exception:
            logger.exception("kv offload: loading %d blocks into the cache failed", len(blocks))
            return 0

    # ------------------------------------------------------------------ lifecycle
    def stats(self) -> OffloadStats:
        return self.store.stats()

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait for the queued writes (tests, benchmarks, shutdown)."""
        return self.store.flush(timeout_s)

    def close(self) -> None:
        self.store.close()
