"""llguidance's packed token bitmask, unpacked to a bool mask.

Below both :mod:`kvserve.structured.compiler` (its compile-time probe) and
:mod:`kvserve.structured.matcher` (the per-step masks), so neither imports the other
for it.
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 words (bit ``b`` of word ``w`` = token ``32 w + b``) ->
    ``[R, vocab_size]`` bool."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
