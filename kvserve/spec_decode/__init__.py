"""Speculative decoding: proposers (n-gram lookup, a draft model), the verifier, the
scheduling rules and the controller that keeps it from ever costing throughput.

See docs/speculative-decoding.md. The scheduler side (``scheduling``) imports no
torch; the runner side (``verify``, ``decoder``, ``draft_model``) does.
"""

from __future__ import annotations

from kvserve.sched.spec_stats import SpecDecodingStats
from kvserve.speculative_config import SpeculativeConfig

__all__ = ["SpecDecodingStats", "SpeculativeConfig"]
