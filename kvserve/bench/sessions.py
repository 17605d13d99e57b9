"""What a benchmark workload is made of: sessions of user turns (plain data).

Built by :mod:`kvserve.bench.workloads` and :mod:`kvserve.bench.spec_workloads`,
sent by :mod:`kvserve.bench.loadgen`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    """One user turn: ``user_text`` (``prompt_len`` tokens) and the answer size."""

    user_text: str
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Session:
    """A conversation: shared ``system_text`` then ``turns`` sent in order.

    ``arrival_s`` fixes when the session starts (seconds after the benchmark starts);
    None means "draw from the load generator's arrival process". ``tag`` groups
    sessions for per-group figures (``decode`` / ``prefill`` in ``interference``).
    """

    session_id: int
    system_text: str
    system_len: int
    turns: tuple[Turn, ...]
    prefix_group: int | None = None
    arrival_s: float | None = None
    tag: str = "default"

    @property
    def num_requests(self) -> int:
        return len(self.turns)
