"""The prefill worker's connector: pushes each chunk's completed blocks to the decode
worker that asked, right after the step that completed them, then ``done``.

    step k ends ─▶ save_kv: blocks completed by step k ─▶ sender thread: gather the
                  pages, send one "chunk" (overlaps step k+1's compute)
    request finishes (its first token) ─▶ "done" queued after its chunks;
                  blocks kept (request_finished returns True) until the decode worker
                  claims them, cancels, or the lease (2 x --kv-transfer-timeout) ends
    preempted ─▶ its queued chunks are sent before the blocks go (pages stay valid)
    cancelled while running ─▶ the service aborts it; nothing more is sent

With ``stream_chunks=False`` every block is saved in the prompt's last step instead
(one transfer at the end), to measure what streaming hides.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.connector import BlockSave, KVConnectorMetadata, LoadResult
from kvserve.kv_transfer.stats import TransferStats
from kvserve.kv_transfer.transport import Transport
from kvserve.kv_transfer.wire import Chunk, Done, Message
from kvserve.request import Request

logger = logging.getLogger(__name__)

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int8: "int8",  # 8-bit caches: the tensor dtype names the format (kernels.kv8)
    torch.uint8: "fp8_e4m3",
}


@dataclass
class _Push:
    """One prefill a decode worker asked for. ``req_id`` is the engine's id;
    ``remote_id`` the decode worker's."""

    req_id: str
    remote_id: str
    peer: str
    first_block: int
    num_blocks: int
    request: Request | None = None
    block_ids: list[int] = field(default_factory=list)
    next_block: int = 0  # first block index not yet saved
    queued: int = 0  # jobs on the sender queue not yet sent
    finished_at: float | None = None  # when the prefill finished (lease start)
    released: bool = False  # claimed or cancelled: free the blocks


class PrefillConnector:
    """Scheduler and worker side of the prefill role. The service
    (``prefill_service``) registers requests with :meth:`track` before adding them
    to the engine and forwards ``claim`` / ``cancel`` here."""

    def __init__(
        self,
        config: KVTransferConfig,
        transport: Transport,
        *,
        block_size: int,
        stats: TransferStats | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.transport = transport
        self.block_size = block_size
        self.stats = stats if stats is not None else TransferStats()
        self.clock = clock
        self._lock = threading.Condition()
        self._pushes: dict[str, _Push] = {}
        self._kv_cache: torch.Tensor | None = None
        self._jobs: queue.SimpleQueue[tuple[_Push, BlockSave | Done, float] | None] = (
            queue.SimpleQueue()
        )
        self._wakeup: Callable[[], None] | None = None
        self._sender = threading.Thread(target=self._send_loop, name="kv-sender", daemon=True)
        self._sender.start()

    # ------------------------------------------------------------------ service API
    @property
    def is_ready(self) -> bool:
        """A prefill worker needs no peer to serve (decode workers come to it)."""
        return True

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup

    def track(
        self, req_id: str, remote_id: str, peer: str, first_block: int, num_blocks: int
    ) -> bool:
        """Register a prefill to push; False (nothing changes) when ``req_id`` is
        already tracked (a duplicate request)."""
        with self._lock:
            if req_id in self._pushes:
                return False
            self._pushes[req_id] = _Push(
                req_id, remote_id, peer, first_block, num_blocks, next_block=first_block
            )
            return True

    def untrack(self, req_id: str) -> None:
        """The engine refused the request: forget it."""
        with self._lock:
            self._pushes.pop(req_id, None)

    def release(self, req_id: str) -> bool:
        """Claim or cancel: free the blocks once sent. Returns True when the request
        is still being prefilled (the caller aborts it in the engine)."""
        with self._lock:
            push = self._pushes.get(req_id)
            if push is None:
                return False
            push.released = True
            running = push.finished_at is None
        self._wake()
        return running

    @property
    def load(self) -> int:
        """Requests held: queued, running, or finished and not yet claimed."""
        with self._lock:
            return len(self._pushes)

    def close(self) -> None:
        self._jobs.put(None)
        self.transport.close()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        with self._lock:
            push = self._pushes.get(request.req_id)
            if push is not None:
                push.request = request
                push.block_ids = list(block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata | None:
        so = scheduler_output
        saves: list[BlockSave] = []
        bs = self.block_size
        with self._lock:
            cached = so.scheduled_cached_reqs
            for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
                push = self._pushes.get(req_id)
                if push is not None:
                    push.block_ids.extend(new_ids)
            for req_id, n in so.num_scheduled_tokens.items():
                push = self._pushes.get(req_id)
                if push is None or push.request is None or push.released:
                    continue
                request = push.request
                end = so.cached_seq_len[req_id] + n
                if not self.config.kv_stream_chunks and end < request.num_prompt_tokens:
                    continue  # send once, in the prompt's last step
                last = min(end // bs, push.first_block + push.num_blocks)
                if last <= push.next_block:
                    continue
                idx = list(range(push.next_block, last))
                saves.append(
                    BlockSave(
                        req_id,
                        [push.block_ids[i] for i in idx],
                        idx,
                        [request.block_hashes[i].hex() for i in idx],
                    )
                )
                push.next_block = last
        return KVConnectorMetadata(saves=saves) if saves else None

    def get_finished_loads(self) -> list[LoadResult]:
        return []

    def get_finished_sending(self) -> set[str]:
        now = self.clock()
        out: set[str] = set()
        with self._lock:
            for req_id, push in list(self._pushes.items()):
                if push.finished_at is None or push.queued:
                    continue
                expired = now - push.finished_at > self.config.lease_s
                if push.released or expired:
                    if expired and not push.released:
                        logger.warning(
                            "no decode worker claimed %s within the %.0f s lease: freeing its blocks",
                            push.remote_id,
                            self.config.lease_s,
                        )
                    del self._pushes[req_id]
                    out.add(req_id)
        return out

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        with self._lock:
            push = self._pushes.get(request.req_id)
            if push is None:
                return False
            if not request.is_finished:
                # Preempted: the pages are about to be reused, so what is queued for
                # them must leave first; the request saves its blocks again from
                # where it restarts.
                while push.queued:
                    self._lock.wait(0.05)
                push.next_block = push.first_block
                return False
            if request.status.name == "FINISHED_ABORTED" or push.released:
                del self._pushes[request.req_id]
                while push.queued:
                    self._lock.wait(0.05)
                return False
            push.finished_at = self.clock()
            push.queued += 1
            token = request.output_token_ids[0] if request.output_token_ids else -1
            self._jobs.put(
                (
                    push,
                    Done(push.remote_id, push.next_block - push.first_block, token, 0.0),
                    push.finished_at,
                )
            )
        return True

    # ------------------------------------------------------------------ worker side
    @property
    def kv_dtype(self) -> str | None:
        """This worker's KV cache format name (None before :meth:`register_kv_cache`)."""
        return None if self._kv_cache is None else DTYPE_NAMES[self._kv_cache.dtype]

    def register_kv_cache(self, kv_cache: Any) -> None:
        self._kv_cache = kv_cache
        # [L, 2, Hk, blocks, B, D]: per token 2 (K, V) x L x Hk x D elements.
        layers, kv, heads, _, _, dim = kv_cache.shape
        self.stats.set_nominal_bytes_per_token(layers * kv * heads * dim * kv_cache.element_size())

    def load_kv(self, metadata: KVConnectorMetadata) -> None:
        return None

    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        now = self.clock()
        with self._lock:
            for save in metadata.saves:
                push = self._pushes.get(save.req_id)
                if push is None:
                    continue
                push.queued += 1
                self._jobs.put((push, save, now))

    # ------------------------------------------------------------------ sender thread
    def _send_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            push, item, saved_time = job
            try:
                if not push.released or isinstance(item, Done):
                    self._send(push, item, saved_time)
            except Exception:
                logger.exception("sending KV of %s failed", push.remote_id)
            finally:
                with self._lock:
                    push.queued -= 1
                    self._lock.notify_all()
                self._wake()

    def _send(self, push: _Push, item: BlockSave | Done, saved_time: float) -> None:
        msg: Message
        if isinstance(item, Done):
            item.compute_end_time = saved_time
            msg = item
        else:
            cache = self._kv_cache
            if cache is None:
                raise RuntimeError("PrefillConnector.save_kv before register_kv_cache")
            index = torch.tensor(item.block_ids, dtype=torch.long, device=cache.device)
            data = cache.index_select(3, index).cpu()  # [L, 2, Hk, n, B, D]
            payload = memoryview(data.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            msg = Chunk(
                req_id=push.remote_id,
                block_indices=item.block_indices,
                block_hashes=item.block_hashes,
                dtype=DTYPE_NAMES[data.dtype],
                shape=list(data.shape),
                saved_time=saved_time,
                payload=payload,
            )
            self.stats.sent(payload.nbytes, len(item.block_ids))
        self.transport.send(push.peer, msg)
