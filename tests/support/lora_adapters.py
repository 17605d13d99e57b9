"""Small seeded LoRA adapters in PEFT's layout, built in a folder (nothing downloaded),
HF transformers models with an adapter merged into their weights, and the small Llama
config the unit tests build adapters for (:func:`tiny_hf_config`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL = ATTN + MLP


def tiny_hf_config() -> Any:
    """A small Llama config for adapter unit tests: hidden 32, 2 layers, 4 heads, 2 KV
    heads, intermediate 48, vocab 64."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )


def shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each target module of a Llama-family HF config."""
    hid = hf_config.hidden_size
    h = hf_config.num_attention_heads
    hk = getattr(hf_config, "num_key_value_heads", h)
    d = getattr(hf_config, "head_dim", None) or hid // h
    inter = hf_config.intermediate_size
    return {
        "q_proj": (h * d, hid),
        "k_proj": (hk * d, hid),
        "v_proj": (hk * d, hid),
        "o_proj": (hid, h * d),
        "gate_proj": (inter, hid),
        "up_proj": (inter, hid),
        "down_proj": (hid, inter),
    }


def make_adapter(
    folder: Path,
    hf_config: Any,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ALL,
    seed: int = 0,
    std: float = 0.02,
    zero_b: bool = False,
    layers: list[int] | None = None,
    extra_config: dict[str, Any] | None = None,
    shape_override: dict[str, tuple[int, ...]] | None = None,
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` with seeded random
    A [r, in] and B [out, r] (B zero with ``zero_b``); returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    sh = shapes(hf_config)
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers if layers is not None else range(hf_config.num_hidden_layers):
        for m in targets:
            out_f, in_f = sh[m]
            part = "self_attn" if m in ATTN else "mlp"
            base = f"base_model.model.model.layers.{layer}.{part}.{m}"
            a = torch.randn(rank, in_f, generator=g) * std
            b = torch.zeros(out_f, rank) if zero_b else torch.randn(out_f, rank, generator=g) * std
            if shape_override and m in shape_override:
                a = torch.zeros(shape_override[m])
            tensors[f"{base}.lora_A.weight"] = a.contiguous()
            tensors[f"{base}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "base_model_name_or_path": "smollm2-135m",
    }
    cfg.update(extra_config or {})
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def merged_hf_model(hf_model: Any, folder: Path) -> Any:
    """A copy of ``hf_model`` with W += (alpha / r) * B @ A for every adapter tensor."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    model = copy.deepcopy(hf_model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            w = params[target]
            w += (scale * (b.double() @ a.double())).to(w.dtype)
    return model.eval()
