"""Speculative decoding, the runner's side: proposers (n-gram lookup, a draft model),
the verifier and the controller that keeps it from ever costing throughput.

See docs/speculative-decoding.md. The scheduler's side is ``kvserve.sched.spec`` (no
torch); this package stands on ``kvserve.sampling`` and under ``kvserve.worker``.
"""

from __future__ import annotations

from kvserve.sched.spec_stats import SpecDecodingStats
from kvserve.speculative_config import SpeculativeConfig

__all__ = ["SpecDecodingStats", "SpeculativeConfig"]
