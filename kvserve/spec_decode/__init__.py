"""Speculative decoding: proposers (n-gram lookup, a draft model), the verifier, the
scheduling rules and the controller that keeps it from ever costing throughput.

See docs/speculative-decoding.md. The scheduler side (``scheduling``) imports no
torch; the runner side (``verify``, ``decoder``, ``draft_model``) does.
"""

from __future__ import annotations

from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.metrics import SpecDecodingStats

__all__ = ["SpecDecodingStats", "SpeculativeConfig"]
