"""Counters of one worker's KV transfers, shared by its connector threads and read by
``/metrics`` (``kvserve.engine.metrics``) and the ``disagg`` bench.

Hidden share (decode side, per remote prefill)::

    prefill:  [ chunk 1 ][ chunk 2 ][ chunk 3 ] <- saved (compute end)
    wire:          [xfer 1]  [xfer 2]  [xfer 3]  <- last block received
                                     exposed = last received - last chunk saved
    busy  = time the link spent carrying this request's chunks (sum over chunks of
            received - max(saved, previous received))
    hidden share = 1 - exposed / busy          (0 when everything is sent at the end)

The timestamps are wall clocks of two processes: exact on one machine, skewed by the
clock offset across machines.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

TRANSFER_SECONDS_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
LONG_PROMPT_TOKENS = 2048  # the "prompts >= 2,048 tokens" figure


@dataclass
class TransferSnapshot:
    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    failures: int = 0
    # kv_transfer_seconds histogram: per request, request sent -> last block loaded
    seconds_buckets: list[int] = field(default_factory=list)
    seconds_count: int = 0
    seconds_sum: float = 0.0
    busy_seconds: float = 0.0  # every remote prefill: link time (for bytes/s)
    long_busy_seconds: float = 0.0  # prompts >= LONG_PROMPT_TOKENS only
    long_exposed_seconds: float = 0.0
    num_long: int = 0
    nominal_bytes_per_token: int = 0  # 2 x layers x KV heads x head dim x dtype bytes
    in_flight: int = 0  # decode side: remote prefills asked for and not yet ended (a gauge)


class TransferStats:
    """Thread-safe counters (see :class:`TransferSnapshot` for the fields)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._s = TransferSnapshot(seconds_buckets=[0] * (len(TRANSFER_SECONDS_BUCKETS) + 1))

    def sent(self, num_bytes: int, num_blocks: int) -> None:
        with self._lock:
            self._s.bytes_sent += num_bytes
            self._s.blocks_sent += num_blocks

    def received(self, num_bytes: int, num_blocks: int) -> None:
        with self._lock:
            self._s.bytes_received += num_bytes
            self._s.blocks_received += num_blocks

    def failed(self) -> None:
        with self._lock:
            self._s.failures += 1

    def finished(self, seconds: float, num_prompt_tokens: int, busy: float, exposed: float) -> None:
        """One remote prefill whose blocks all arrived."""
        with self._lock:
            s = self._s
            s.seconds_buckets[bisect.bisect_left(TRANSFER_SECONDS_BUCKETS, seconds)] += 1
            s.seconds_count += 1
            s.seconds_sum += seconds
            s.busy_seconds += busy
            if num_prompt_tokens >= LONG_PROMPT_TOKENS:
                s.long_busy_seconds += busy
                s.long_exposed_seconds += min(max(exposed, 0.0), busy)
                s.num_long += 1

    def set_in_flight(self, num_requests: int) -> None:
        """The decode connector's count of remote prefills it waits on, after a change."""
        with self._lock:
            self._s.in_flight = num_requests

    def set_nominal_bytes_per_token(self, num_bytes: int) -> None:
        with self._lock:
            self._s.nominal_bytes_per_token = num_bytes

    def snapshot(self) -> TransferSnapshot:
        with self._lock:
            s = self._s
            return TransferSnapshot(**{**s.__dict__, "seconds_buckets": list(s.seconds_buckets)})
