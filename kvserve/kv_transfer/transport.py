"""The transport seam under the connectors: messages (``kvserve.kv_transfer.wire``)
to and from named peers, and an in-process implementation for tests.

Rules a caller must keep: ``send`` may be called from any thread and never blocks on
the network (a message to a peer that is gone is dropped, as on a real network);
the receiver callback runs on the transport's own thread, must not block for long
and must not call back into the engine (it only records what arrived).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol

from kvserve.kv_transfer.wire import Message, WireError, decode_message, encode_message

Receiver = Callable[[str, Message], None]


class Transport(Protocol):
    """Sends messages to peers by name; hands received ones to the receiver."""

    def set_receiver(self, receiver: Receiver) -> None: ...

    def send(self, peer: str, msg: Message) -> None: ...

    def close(self) -> None: ...


class InProcessTransport:
    """One end of an in-process link (see :func:`in_process_pair`). Messages go
    through the wire encoding both ways and are delivered in order on a delivery
    thread; ``intercept`` (tests) may drop, duplicate or reorder them: it gets each
    encoded message and returns the list of messages to deliver now."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.other: InProcessTransport | None = None
        self._receiver: Receiver | None = None
        self._queue: queue.Queue[tuple[str, list[bytes | memoryview]] | None] = queue.Queue()
        self.intercept: (
            Callable[[list[bytes | memoryview]], list[list[bytes | memoryview]]] | None
        ) = None
        self.num_malformed = 0
        self._thread = threading.Thread(target=self._deliver, name=f"kv-inproc-{name}", daemon=True)
        self._thread.start()

    def set_receiver(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def send(self, peer: str, msg: Message) -> None:
        other = self.other
        if other is None:
            return
        frames: list[bytes | memoryview] = [bytes(f) for f in encode_message(msg)]
        batches = [frames] if self.intercept is None else self.intercept(frames)
        for batch in batches:
            other._queue.put((self.name, list(batch)))

    def _deliver(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                sender, frames = item
                try:
                    msg = decode_message(frames)
                except WireError:
                    self.num_malformed += 1
                    continue
                if self._receiver is not None:
                    self._receiver(sender, msg)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every message queued to this end so far was delivered (tests)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)


def in_process_pair(
    a: str = "decode", b: str = "prefill"
) -> tuple[InProcessTransport, InProcessTransport]:
    """Two linked ends; each end names the other ``b`` / ``a`` when it receives."""
    end_a, end_b = InProcessTransport(a), InProcessTransport(b)
    end_a.other, end_b.other = end_b, end_a
    return end_a, end_b
