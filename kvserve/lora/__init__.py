"""Multi-LoRA serving: PEFT adapters over one base model, mixed in one batch.

- :mod:`kvserve.lora.config`  ``LoRAConfig`` (engine flags) and ``LoRARequest`` (offline API)
- :mod:`kvserve.lora.adapter` reading and checking a PEFT folder against the base model
- :mod:`kvserve.lora.weights` the slot-stacked A/B tensors and the batched low-rank delta
- :mod:`kvserve.lora.manager` names, slots, in-use counts and unload waits

docs/lora.md has the user's view.
"""

from __future__ import annotations

from kvserve.lora.config import LoRAConfig, LoRARequest
from kvserve.lora.errors import LoRAError

__all__ = ["LoRAConfig", "LoRAError", "LoRARequest"]
