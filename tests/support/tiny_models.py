"""Small random Llama models built in memory (no files), for kernel and runner tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from kvserve.model.arch import ModelArchConfig
from kvserve.model.llama import LlamaForCausalLM


def random_llama(
    vocab_size: int, hidden_size: int, intermediate_size: int, *, tied: bool = False
) -> LlamaForCausalLM:
    """Two layers, 4 heads, 2 KV heads, 128 positions; weights drawn from N(0, 0.5)
    after ``torch.manual_seed(0)`` (the same model at every call), float32."""
    cfg = ModelArchConfig.from_hf_config(
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=tied,
            architectures=["LlamaForCausalLM"],
        )
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model
