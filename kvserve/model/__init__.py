"""Models: loading (HF folders, GGUF, named defaults), the Llama-family network and
attention over the paged KV cache.

- ``loader``: ``resolve_model``, ``load_tokenizer``, ``load_model`` -> ``LoadedModel``
- ``llama``: ``LlamaForCausalLM`` over a flat token batch (Llama, Mistral, Qwen2, Qwen3)
- ``attention``: KV writes, segmented prefill attention, batched decode attention
"""

from __future__ import annotations

from kvserve.model.loader import (
    DEFAULT_MODEL_NAME,
    SUPPORTED_ARCHITECTURES,
    LoadedModel,
    load_model,
    load_tokenizer,
    resolve_model,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "SUPPORTED_ARCHITECTURES",
    "LoadedModel",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
