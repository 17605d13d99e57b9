"""Small random Llama models: built in memory (no files), for kernel and runner tests,
or saved as HF folders (safetensors + config + the default model's tokenizer) for the
loader tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_hf_folder(hf_model: Any, folder: Path, tokenizer_dir: Path) -> None:
    """``hf_model.save_pretrained(folder)`` plus the tokenizer files of the model folder
    ``tokenizer_dir`` (the default model's: its vocabulary must cover the model's)."""
    hf_model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())


def save_tiny_hf_llama(
    folder: Path, tokenizer_dir: Path, *, hidden_size: int = 32, intermediate_size: int = 64
) -> None:
    """A 1-layer HF Llama (vocab 128, 2 heads, 1 KV head) with transformers' random
    initialization (from torch's global generator: seed it first for fixed weights),
    saved by :func:`save_hf_folder`."""
    from transformers import LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    save_hf_folder(LlamaForCausalLM(cfg), folder, tokenizer_dir)


# the default model's layout (SmolLM2-135M: head_dim 64, 3 query heads per KV head,
# tied embeddings, rope theta 100000) at 2 layers and a smaller width
SMALL_LIKE_DEFAULT: dict[str, Any] = {
    "vocab_size": 1024, "hidden_size": 192, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1,
    "max_position_embeddings": 512, "rope_theta": 100000.0, "tie_word_embeddings": True,
}  # fmt: skip


def save_small_llama_like_default(folder: Path, tokenizer_dir: Path) -> None:
    """A 2-layer HF Llama with the default model's layout at a smaller width: head_dim
    64, 3 query heads per KV head, tied embeddings, rope theta 100000 (vocab 1024,
    hidden 192, intermediate 512, 512 positions). Weights N(0, 0.1) after
    ``torch.manual_seed(0)``, norms one, so greedy picks are clear. For tests whose
    subject is the engine's code path (``--compile``), not the model: the compile of
    a 2-layer graph takes a fraction of the 30-layer default's. Saved by
    :func:`save_hf_folder`; prompts must use token ids below 1024."""
    from transformers import LlamaForCausalLM

    cfg = LlamaConfig(**SMALL_LIKE_DEFAULT)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1)
    save_hf_folder(model, folder, tokenizer_dir)
