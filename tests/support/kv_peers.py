"""Stand-ins for the other side of a KV transfer, over the real TCP transport: a fake
prefill peer (answers pings, records prefill requests, then stays silent or refuses)
and a fake decode worker (asks a real prefill worker for blocks and never claims)."""

from __future__ import annotations

import threading
import time

from kvserve.kv_transfer.tcp import DealerTransport, RouterTransport
from kvserve.kv_transfer.wire import Error, Message, Ping, Pong, PrefillRequest


class FakePrefillPeer:
    """``alive``: answer pings. ``refuse``: answer prefill requests with an error
    (else stay silent, like a peer slower than any timeout)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.alive = True
        self.refuse = False
        self.requests: list[PrefillRequest] = []
        self._transport = RouterTransport("127.0.0.1", port)
        self._transport.set_receiver(self._on)

    def _on(self, peer: str, msg: Message) -> None:
        if not self.alive:
            return
        if isinstance(msg, Ping):
            self._transport.send(peer, Pong(msg.seq, 0))
        elif isinstance(msg, PrefillRequest):
            self.requests.append(msg)
            if self.refuse:
                self._transport.send(peer, Error(msg.req_id, "refused by the test"))

    def close(self) -> None:
        self._transport.close()


class FakeDecodeWorker:
    """Sends prefill requests to a real prefill worker and records what comes back."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.messages: list[Message] = []
        self._cond = threading.Condition()
        self._transport = DealerTransport([address])
        self._transport.set_receiver(self._on)

    def _on(self, peer: str, msg: Message) -> None:
        with self._cond:
            self.messages.append(msg)
            self._cond.notify_all()

    def send(self, msg: Message) -> None:
        self._transport.send(self.address, msg)

    def wait_for(self, kind: str, timeout_s: float = 60.0) -> Message:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for m in self.messages:
                    if m.kind == kind:
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {kind!r} message in {timeout_s} s: {self.messages}")
                self._cond.wait(left)

    def close(self) -> None:
        self._transport.close()
