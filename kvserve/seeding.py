"""The one 64-bit mixer behind every derived seed (sample seeds, per-step draws).

Pure Python, so a seeded request draws the same numbers on every platform.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(a: int, b: int, b_multiplier: int) -> int:
    """A 63-bit value mixed from ``(a, b)``: ``a * golden + b * b_multiplier`` through the
    splitmix64 finalizer. Nearby inputs give unrelated outputs; callers pick distinct
    ``b_multiplier`` constants so two derivations from one seed never coincide."""
    x = (a * _GOLDEN + b * b_multiplier) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)
