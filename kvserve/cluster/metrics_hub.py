"""MetricsHub: the latest Prometheus text of every engine replica, for ``/metrics``.

Each replica pushes its own text every ``metrics_push_s`` seconds (``push``); the
ingress reads them all at scrape time (``snapshot``). A replica that stopped pushing
for ``stale_after_s`` seconds (killed, scaled away) is left out. Runs as a Serve
deployment of one replica; it holds nothing that cannot be rebuilt by the next push.
"""

from __future__ import annotations

import time
from typing import Any


class MetricsHub:
    def __init__(self, stale_after_s: float = 10.0) -> None:
        self.stale_after_s = stale_after_s
        self._latest: dict[str, tuple[int, float, str]] = {}

    def push(self, replica: str, pid: int, text: str) -> None:
        self._latest[replica] = (pid, time.monotonic(), text)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """{replica: {"pid", "age_s", "text"}} for every replica heard from lately."""
        now = time.monotonic()
        for replica in [r for r, (_, t, _) in self._latest.items() if now - t > self.stale_after_s]:
            del self._latest[replica]
        return {
            r: {"pid": pid, "age_s": now - t, "text": text}
            for r, (pid, t, text) in self._latest.items()
        }
