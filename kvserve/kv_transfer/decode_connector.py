"""The decode worker's connector: asks a prefill peer for the uncached full blocks of
a prompt, receives them chunk by chunk, checks their hashes and loads them.

Per remote prefill (all under one lock; the transport thread only records)::

    admission   get_num_new_matched_tokens -> blocks [first, first+n) are external
                update_state_after_alloc   -> "prefill" sent to the least-loaded peer
    transport   "chunk"  -> hashes checked against the request's own chain, new
                            blocks queued for loading (duplicates and late chunks
                            are ignored; order does not matter: blocks go by index)
                "done"   -> the peer pushed everything
    each step   build_connector_meta  -> queued blocks go to the worker side, which
                                         writes them into the pages before the step
                get_finished_loads    -> all loaded: "claim" sent, request resumes
                                         with num_computed_tokens past them; failed
                                         (peer silent for the timeout or not alive,
                                         error, hash mismatch): "cancel" sent, resume
                                         after the loaded whole-block prefix
                                         (recompute) or end with the error (fail)
    abort       request_finished -> "cancel" sent, state dropped, blocks freed

The peer is the least-loaded alive one, or the one a ``peer_chooser`` picks among the
alive ones (a Ray pool: by the prefix it probably holds, and load). The peers may
change while it runs (:meth:`DecodeConnector.set_peers`): a request whose peer was
taken out fails its load at once (recompute or fail, as for a silent peer).

Prompts whose uncached full-block part is under ``remote_min_tokens`` stay local.
The last ``1..B`` prompt tokens are always computed locally: they include the token
whose logits give the first output, and a partial block has no hash to check.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.connector import BlockLoad, KVConnectorMetadata, LoadResult
from kvserve.kv_transfer.peers import PeerTable
from kvserve.kv_transfer.stats import TransferStats
from kvserve.kv_transfer.transport import Transport
from kvserve.kv_transfer.wire import (
    Cancel,
    Chunk,
    Claim,
    Done,
    Error,
    Message,
    Ping,
    Pong,
    PrefillRequest,
)
from kvserve.request import Request

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 0.25
TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,  # 8-bit KV formats (kvserve.model.kernels.kv8)
    "fp8_e4m3": torch.uint8,
}


class PeerChooser(Protocol):
    """Picks the prefill peer of a remote prefill. Rules: ``choose`` gets the request
    and the alive peers (never empty) and returns one of them; every ``choose`` is
    matched by one ``finished(req_id)`` when that load ends (any outcome). Both are
    called on the engine thread with the connector's lock held: never call back."""

    def choose(self, request: Request, alive: list[str]) -> str: ...

    def finished(self, req_id: str) -> None: ...


@dataclass
class _Remote:
    req_id: str
    peer: str
    num_prompt_tokens: int
    first_block: int
    block_ids: list[int]  # this engine's blocks for indices first_block, first_block+1, ...
    hashes: list[str]
    sent_time: float
    last_heard: float
    received: set[int] = field(default_factory=set)
    loaded: set[int] = field(default_factory=set)
    pending: list[BlockLoad] = field(default_factory=list)
    done: Done | None = None
    error: str | None = None
    busy_s: float = 0.0
    last_recv: float = 0.0
    last_saved: float = 0.0  # latest saved_time of a chunk: the end of prefill compute


class DecodeConnector:
    """Scheduler and worker side of the decode role (one object, engine thread), fed
    by a :class:`~kvserve.kv_transfer.transport.Transport` (its own thread)."""

    def __init__(
        self,
        config: KVTransferConfig,
        transport: Transport,
        *,
        block_size: int,
        kv_dtype: str,
        stats: TransferStats | None = None,
        clock: Callable[[], float] = time.time,
        ping: bool = True,
        peer_chooser: PeerChooser | None = None,
    ) -> None:
        self.config = config
        self.peer_chooser = peer_chooser
        self.transport = transport
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.stats = stats if stats is not None else TransferStats()
        self.clock = clock
        self.peers = PeerTable(
            list(config.kv_prefill_peers), clock, stale_s=min(config.kv_transfer_timeout, 2.0)
        )
        self._lock = threading.Lock()
        self._remote: dict[str, _Remote] = {}
        self._results: list[LoadResult] = []
        self._wakeup: Callable[[], None] | None = None
        self._kv_cache: torch.Tensor | None = None
        self._closed = threading.Event()
        transport.set_receiver(self._on_message)
        self._pinger: threading.Thread | None = None
        if ping:
            self._pinger = threading.Thread(target=self._ping_loop, name="kv-ping", daemon=True)
            self._pinger.start()

    # ------------------------------------------------------------------ lifecycle
    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """Called (any thread) when something arrived that the engine should look at."""
        self._wakeup = wakeup

    def close(self) -> None:
        self._closed.set()
        self.transport.close()

    def set_peers(self, addresses: list[str]) -> None:
        """Use exactly these prefill peers from now on (any thread). A new peer is used
        once it answers a ping; a request whose peer is dropped fails its load at the
        next step. The transport must be a :class:`~kvserve.kv_transfer.tcp.DealerTransport`
        (or have its ``set_peers``)."""
        set_transport_peers = getattr(self.transport, "set_peers", None)
        if set_transport_peers is None:
            raise TypeError(f"{type(self.transport).__name__} has a fixed peer list")
        with self._lock:
            if addresses == self.peers.addresses:
                return
            self.peers.set_addresses(list(addresses))
        set_transport_peers(list(addresses))
        self._wake()

    def _ping_loop(self) -> None:
        seq = 0
        while not self._closed.wait(PING_INTERVAL_S if seq else 0.0):
            seq += 1
            with self._lock:
                addresses = self.peers.addresses
            for peer in addresses:
                self.transport.send(peer, Ping(seq))
            self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup()

    @property
    def is_ready(self) -> bool:
        """False until a prefill peer has answered a ping: before that every long
        prompt would be prefilled locally ("no prefill peer alive") although the peer
        is only starting, so the server reports not ready (``/health`` 503) until
        then. Once true it stays true: a peer lost later is the failure policy's."""
        with self._lock:
            return self.peers.any_answered

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if request.num_output_tokens or request.num_preemptions:
            return 0  # only fresh prompts go out; a preempted one recomputes locally
        bs = self.block_size
        p_full = (request.num_prompt_tokens - 1) // bs * bs
        n = p_full - num_computed_tokens
        if n < self.config.kv_remote_min_tokens:
            return 0
        with self._lock:
            alive = bool(self.peers.alive())
        if not alive and self.config.kv_load_failure_policy == "recompute":
            self.stats.failed()  # unreachable: prefill locally
            logger.warning("no prefill peer alive; prefilling %s locally", request.req_id)
            return 0
        return n

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        first = request.num_computed_tokens // bs
        num = num_external_tokens // bs
        now = self.clock()
        with self._lock:
            peer = self._choose_peer(request)
            remote = _Remote(
                req_id=request.req_id,
                peer=peer or "",
                num_prompt_tokens=request.num_prompt_tokens,
                first_block=first,
                block_ids=list(block_ids[first : first + num]),
                hashes=[h.hex() for h in request.block_hashes[first : first + num]],
                sent_time=now,
                last_heard=now,
            )
            self._remote[request.req_id] = remote
            self.stats.set_in_flight(len(self._remote))
            if peer is None:
                remote.error = "no prefill peer is reachable"
                return
            self.peers.started(peer)
        self.transport.send(
            peer,
            PrefillRequest(
                req_id=request.req_id,
                prompt_token_ids=list(request.prompt_token_ids),
                first_block=first,
                num_blocks=num,
                cache_salt=request.cache_salt,
                kv_dtype=self.kv_dtype,
            ),
        )

    def _choose_peer(self, request: Request) -> str | None:
        """The peer for ``request`` (lock held), or None when no peer is alive."""
        if self.peer_chooser is None:
            return self.peers.choose()
        alive = self.peers.alive()
        return self.peer_chooser.choose(request, alive) if alive else None

    def _ended(self, remote: _Remote) -> None:
        """The remote prefill ended (lock held)."""
        if remote.peer:
            self.peers.ended(remote.peer)
            if self.peer_chooser is not None:
                self.peer_chooser.finished(remote.req_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata | None:
        loads: list[BlockLoad] = []
        with self._lock:
            for remote in self._remote.values():
                if remote.pending:
                    loads.extend(remote.pending)
                    for load in remote.pending:
                        remote.loaded.update(remote.block_ids.index(b) for b in load.block_ids)
                    remote.pending = []
        return KVConnectorMetadata(loads=loads) if loads else None

    def get_finished_loads(self) -> list[LoadResult]:
        now = self.clock()
        out: list[LoadResult] = []
        with self._lock:
            for req_id in list(self._remote):
                remote = self._remote[req_id]
                result = self._check(remote, now)
                if result is None:
                    continue
                del self._remote[req_id]
                self._ended(remote)
                out.append(result)
            self.stats.set_in_flight(len(self._remote))
        return out

    def _check(self, remote: _Remote, now: float) -> LoadResult | None:
        """The request's result if its load ended (lock held); sends claim/cancel."""
        num = len(remote.block_ids)
        if remote.error is None and len(remote.loaded) == num:
            # Every block is in (a lost "done" changes nothing: it only carries the
            # prefill worker's first token, which this worker computes itself).
            self.stats.finished(
                now - remote.sent_time,
                remote.num_prompt_tokens,
                remote.busy_s,
                remote.last_recv - remote.last_saved,
            )
            self.transport.send(remote.peer, Claim(remote.req_id))
            return LoadResult(remote.req_id, num * self.block_size)
        error = remote.error
        if error is None and now - remote.last_heard > self.config.kv_transfer_timeout:
            error = (
                f"prefill peer {remote.peer} sent nothing for {self.config.kv_transfer_timeout:g} s"
            )
        if error is None and not self.peers.is_alive(remote.peer):
            error = f"prefill peer {remote.peer} stopped answering"
        if error is None:
            return None
        self.stats.failed()
        if remote.peer:
            self.transport.send(remote.peer, Cancel(remote.req_id))
        ok = 0
        while ok < num and ok in remote.loaded:
            ok += 1
        fatal = self.config.kv_load_failure_policy == "fail"
        logger.warning(
            "remote prefill of %s failed (%s); %s",
            remote.req_id,
            error,
            "failing the request" if fatal else f"computing the last {num - ok} blocks locally",
        )
        return LoadResult(remote.req_id, ok * self.block_size, error=error, fatal=fatal)

    def get_finished_sending(self) -> set[str]:
        return set()

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        with self._lock:
            remote = self._remote.pop(request.req_id, None)
            self.stats.set_in_flight(len(self._remote))
            if remote is not None:
                self._ended(remote)
        if remote is not None and remote.peer:
            self.transport.send(remote.peer, Cancel(request.req_id))
        return False

    # ------------------------------------------------------------------ worker side
    def register_kv_cache(self, kv_cache: Any) -> None:
        self._kv_cache = kv_cache
        # [L, 2, Hk, blocks, B, D]: per token 2 (K, V) x L x Hk x D elements.
        layers, kv, heads, _, _, dim = kv_cache.shape
        self.stats.set_nominal_bytes_per_token(layers * kv * heads * dim * kv_cache.element_size())

    def load_kv(self, metadata: KVConnectorMetadata) -> None:
        cache = self._kv_cache
        if cache is None:
            raise RuntimeError("DecodeConnector.load_kv before register_kv_cache")
        for load in metadata.loads:
            index = torch.tensor(load.block_ids, dtype=torch.long, device=cache.device)
            cache.index_copy_(3, index, load.data.to(cache.device))

    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        return None

    # ------------------------------------------------------------------ transport thread
    def _on_message(self, peer: str, msg: Message) -> None:
        now = self.clock()
        if isinstance(msg, Pong):
            with self._lock:
                self.peers.pong(peer, msg.load)
            return
        if not isinstance(msg, Chunk | Done | Error):
            return
        with self._lock:
            remote = self._remote.get(msg.req_id)
            if remote is None or remote.peer != peer or remote.error is not None:
                return  # late (finished, aborted, failed) or from the wrong peer: ignored
            remote.last_heard = now
            if isinstance(msg, Done):
                remote.done = msg
            elif isinstance(msg, Error):
                remote.error = f"prefill peer {peer} refused: {msg.message}"
            else:
                self._on_chunk(remote, msg, now)
        self._wake()

    def _on_chunk(self, remote: _Remote, chunk: Chunk, now: float) -> None:
        if chunk.dtype != self.kv_dtype:  # before the hashes (they differ too)
            remote.error = (
                f"KV cache dtype mismatch: the prefill peer sent {chunk.dtype} KV but this "
                f"worker's KV cache is {self.kv_dtype}; start both with the same "
                "--kv-cache-dtype"
            )
            return
        num = len(remote.block_ids)
        new_pos: list[int] = []
        for j, (index, digest) in enumerate(
            zip(chunk.block_indices, chunk.block_hashes, strict=True)
        ):
            i = index - remote.first_block
            if not 0 <= i < num:
                remote.error = f"chunk names block {index}, outside the blocks asked for"
                return
            if digest != remote.hashes[i]:
                remote.error = (
                    f"block {index} hash mismatch (the peer computed different tokens or model)"
                )
                return
            if i not in remote.received:
                new_pos.append(j)
        self.stats.received(memoryview(chunk.payload).nbytes, len(chunk.block_indices))
        remote.busy_s += max(0.0, now - max(chunk.saved_time, remote.last_recv))
        remote.last_recv = now
        remote.last_saved = max(remote.last_saved, chunk.saved_time)
        if not new_pos:
            return  # a duplicate
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only copy from it
            data = torch.frombuffer(chunk.payload, dtype=TORCH_DTYPES[chunk.dtype])
        data = data.view(chunk.shape)
        if len(new_pos) != len(chunk.block_indices):
            data = data.index_select(3, torch.tensor(new_pos, dtype=torch.long))
        ids: list[int] = []
        for j in new_pos:
            i = chunk.block_indices[j] - remote.first_block
            remote.received.add(i)
            ids.append(remote.block_ids[i])
        remote.pending.append(BlockLoad(remote.req_id, ids, data))
