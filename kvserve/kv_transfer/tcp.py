"""The TCP transport over ZeroMQ: works across machines.

- A prefill worker binds one ROUTER socket on ``--kv-address``
  (:class:`RouterTransport`); a peer's name is its ZeroMQ identity (hex).
- A decode worker connects one DEALER socket per prefill peer
  (:class:`DealerTransport`); a peer's name is its ``HOST:PORT``. The peer list may
  change while it runs (:meth:`DealerTransport.set_peers`: the prefill pool of a Ray
  deployment, whose replicas come and go).
- Port 0 binds a free port (:attr:`RouterTransport.address` tells which).

Each transport owns its sockets on one I/O thread (ZeroMQ sockets are not thread
safe): ``send`` only queues, the thread polls the sockets and the queue. Messages
are ``kvserve.kv_transfer.wire`` frames; chunk payloads go out without a copy.
DEALER sockets use ``IMMEDIATE`` so nothing queues for a peer that is not connected
(a peer that comes back gets only new messages), and ``LINGER 0`` so closing never
hangs. Malformed input is dropped and counted (``num_malformed``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

import zmq

from kvserve.kv_transfer.transport import Receiver
from kvserve.kv_transfer.wire import Message, WireError, decode_message, encode_message

logger = logging.getLogger(__name__)

_POLL_MS = 2
_HWM = 10_000


class _ZmqTransport:
    def __init__(self, name: str) -> None:
        self._ctx = zmq.Context()
        self._receiver: Receiver | None = None
        self._outbox: queue.SimpleQueue[tuple[str, Message] | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self.num_malformed = 0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def set_receiver(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def send(self, peer: str, msg: Message) -> None:
        if not self._closed.is_set():
            self._outbox.put((peer, msg))

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._outbox.put(None)
            self._thread.join(timeout=5.0)
            self._ctx.term()

    # subclass hooks ---------------------------------------------------------
    def _update_sockets(self, poller: zmq.Poller) -> None:
        """On the I/O thread, before each poll: open or close sockets asked for."""

    def _sockets(self) -> list[zmq.Socket]:  # type: ignore[type-arg]
        raise NotImplementedError

    def _write(self, peer: str, frames: list[bytes | memoryview]) -> None:
        raise NotImplementedError

    def _read(self, sock: zmq.Socket) -> tuple[str, Sequence[bytes | memoryview]]:  # type: ignore[type-arg]
        raise NotImplementedError

    # the I/O thread ---------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets():
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._closed.is_set():
                self._update_sockets(poller)
                self._drain_outbox()
                for sock, _ in poller.poll(_POLL_MS):
                    while True:
                        try:
                            peer, frames = self._read(sock)
                        except zmq.Again:
                            break
                        self._handle(peer, frames)
        except zmq.ZMQError as e:
            if not self._closed.is_set():
                logger.exception("KV transport I/O thread stopped: %s", e)
        finally:
            for sock in self._sockets():
                sock.close(linger=0)

    def _drain_outbox(self) -> None:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                return
            peer, msg = item
            try:
                self._write(peer, encode_message(msg))
            except (zmq.Again, KeyError):
                self.num_dropped += 1  # peer gone or not connected: as if lost on the wire

    def _handle(self, peer: str, frames: Sequence[bytes | memoryview]) -> None:
        try:
            msg = decode_message(frames)
        except WireError as e:
            self.num_malformed += 1
            logger.warning("dropped a malformed KV transfer message from %s: %s", peer, e)
            return
        if self._receiver is not None:
            try:
                self._receiver(peer, msg)
            except Exception:  # a receiver bug must not kill the I/O thread
                logger.exception("KV transfer receiver failed on a %s message", msg.kind)


class RouterTransport(_ZmqTransport):
    """Prefill side: binds ``tcp://HOST:PORT`` (port 0: a free one); replies go to the
    sender's identity. ``address``: the ``HOST:PORT`` it listens on."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__("kv-router")
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if port == 0:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
        self.address = f"{host}:{port}"
        self._thread.start()

    def _sockets(self) -> list[zmq.Socket]:  # type: ignore[type-arg]
        return [self._sock]

    def _write(self, peer: str, frames: list[bytes | memoryview]) -> None:
        try:
            self._sock.send_multipart([bytes.fromhex(peer), *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise KeyError(peer) from None
            raise

    def _read(self, sock: zmq.Socket) -> tuple[str, Sequence[bytes | memoryview]]:  # type: ignore[type-arg]
        ident, *frames = sock.recv_multipart(flags=zmq.NOBLOCK)
        return bytes(ident).hex(), frames


class DealerTransport(_ZmqTransport):
    """Decode side: one DEALER per peer address ``HOST:PORT``. Rules: :meth:`set_peers`
    may be called from any thread; a message to a peer not (or no longer) in the list
    is dropped, as on a real network."""

    def __init__(self, peers: list[str]) -> None:
        super().__init__("kv-dealer")
        self._by_peer: dict[str, zmq.Socket] = {}  # type: ignore[type-arg]
        self._peer_of: dict[zmq.Socket, str] = {}  # type: ignore[type-arg]
        self._wanted: list[str] | None = None  # set_peers' latest list, for the I/O thread
        self._wanted_lock = threading.Lock()
        for peer in peers:
            self._open(peer)
        self._thread.start()

    @property
    def peers(self) -> list[str]:
        """The peers sockets are open for (the I/O thread's view)."""
        return list(self._by_peer)

    def set_peers(self, peers: list[str]) -> None:
        """Connect to exactly ``peers`` from now on (new ones are connected, dropped ones
        closed, at the I/O thread's next turn)."""
        with self._wanted_lock:
            self._wanted = list(peers)

    def _open(self, peer: str) -> zmq.Socket:  # type: ignore[type-arg]
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, _HWM)
        sock.setsockopt(zmq.RCVHWM, _HWM)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.connect(f"tcp://{peer}")
        self._by_peer[peer] = sock
        self._peer_of[sock] = peer
        return sock

    def _update_sockets(self, poller: zmq.Poller) -> None:
        with self._wanted_lock:
            wanted, self._wanted = self._wanted, None
        if wanted is None:
            return
        for peer in [p for p in self._by_peer if p not in wanted]:
            sock = self._by_peer.pop(peer)
            del self._peer_of[sock]
            poller.unregister(sock)
            sock.close(linger=0)
        for peer in wanted:
            if peer not in self._by_peer:
                poller.register(self._open(peer), zmq.POLLIN)

    def _sockets(self) -> list[zmq.Socket]:  # type: ignore[type-arg]
        return list(self._by_peer.values())

    def _write(self, peer: str, frames: list[bytes | memoryview]) -> None:
        self._by_peer[peer].send_multipart(frames, flags=zmq.NOBLOCK, copy=False)

    def _read(self, sock: zmq.Socket) -> tuple[str, Sequence[bytes | memoryview]]:  # type: ignore[type-arg]
        return self._peer_of[sock], sock.recv_multipart(flags=zmq.NOBLOCK)
