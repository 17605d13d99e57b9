"""The prefill worker's front: turns ``prefill`` messages into engine requests.

    transport thread                     event loop (AsyncEngine's)
    "prefill" ─ checks, track() ───────▶ submit(max_tokens=1, greedy), drain the
                                          stream; a refusal goes back as "error"
    "cancel"  ─ release() ─────────────▶ abort in the engine if still running
    "claim"   ─ release()                (blocks freed by the engine thread)
    "ping"    ─ "pong" with the load

Engine request ids are ``<peer>/<decode request id>``, so two decode workers never
collide. Everything that goes back to a decode worker (chunks, done) is sent by the
:class:`~kvserve.kv_transfer.prefill_connector.PrefillConnector`, except errors and
pongs, sent here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvserve.kv_transfer.prefill_connector import PrefillConnector
from kvserve.kv_transfer.transport import Transport
from kvserve.kv_transfer.wire import Cancel, Claim, Error, Message, Ping, Pong, PrefillRequest
from kvserve.request import SamplingParams

logger = logging.getLogger(__name__)


class PrefillService:
    """Rules: :meth:`start` on the event loop the ``async_engine`` streams to."""

    def __init__(
        self, async_engine: Any, connector: PrefillConnector, transport: Transport
    ) -> None:
        self.engine = async_engine
        self.connector = connector
        self.transport = transport
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.transport.set_receiver(self._on_message)

    def close(self) -> None:
        self.connector.close()

    # ------------------------------------------------------------------ transport thread
    def _on_message(self, peer: str, msg: Message) -> None:
        if isinstance(msg, Ping):
            self.transport.send(peer, Pong(msg.seq, self.connector.load))
            return
        if isinstance(msg, Claim | Cancel):
            req_id = f"{peer}/{msg.req_id}"
            if self.connector.release(req_id) and self._loop is not None:
                self._loop.call_soon_threadsafe(self.engine.abort, req_id)
            return
        if isinstance(msg, PrefillRequest):
            problem = self._check(msg)
            if problem is not None:
                self.transport.send(peer, Error(msg.req_id, problem))
                return
            req_id = f"{peer}/{msg.req_id}"
            if not self.connector.track(req_id, msg.req_id, peer, msg.first_block, msg.num_blocks):
                return  # a duplicate of a prefill already under way: ignored
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._spawn, peer, msg, req_id)

    def _check(self, msg: PrefillRequest) -> str | None:
        mine = self.connector.kv_dtype
        if msg.kv_dtype is not None and mine is not None and msg.kv_dtype != mine:
            return (
                f"KV cache dtype mismatch: this prefill worker stores {mine} KV, the decode "
                f"worker {msg.kv_dtype}; start both with the same --kv-cache-dtype"
            )
        bs = self.connector.block_size
        n = len(msg.prompt_token_ids)
        if msg.num_blocks < 1 or (msg.first_block + msg.num_blocks) * bs > n:
            return (
                f"blocks [{msg.first_block}, {msg.first_block + msg.num_blocks}) of {bs} tokens "
                f"do not lie inside the {n}-token prompt"
            )
        return None

    # ------------------------------------------------------------------ event loop
    def _spawn(self, peer: str, msg: PrefillRequest, req_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._prefill(peer, msg, req_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prefill(self, peer: str, msg: PrefillRequest, req_id: str) -> None:
        try:
            stream = await self.engine.generate(
                msg.prompt_token_ids,
                SamplingParams(max_tokens=1, temperature=0.0),
                request_id=req_id,
                cache_salt=msg.cache_salt,
            )
            async for _ in stream:
                pass
        except Exception as e:  # refused (too long, queue full, shutting down)
            self.connector.untrack(req_id)
            self.transport.send(peer, Error(msg.req_id, str(e)))
