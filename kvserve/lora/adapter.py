"""Read a PEFT LoRA folder and check it against the base model.

A folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
optional ``use_rslora``) and ``adapter_model.safetensors`` with tensors named like
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ([r, in]) and
``...lora_B.weight`` ([out, r]). Supported targets: q/k/v/o_proj and
gate/up/down_proj of a Llama-family decoder. Everything else PEFT can write
(DoRA, biases, ``modules_to_save``, per-module ranks, embeddings) is refused with a
:class:`LoRAError`, so an adapter never runs differently from what it was trained as.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.lora.errors import LoRAError
from kvserve.model.arch import ModelArchConfig

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.default)?\.weight$"
)


def module_shapes(c: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target module of the base model."""
    h, hk, d, hid, inter = (
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.hidden_size,
        c.intermediate_size,
    )
    return {
        "q_proj": (h * d, hid),
        "k_proj": (hk * d, hid),
        "v_proj": (hk * d, hid),
        "o_proj": (hid, h * d),
        "gate_proj": (inter, hid),
        "up_proj": (inter, hid),
        "down_proj": (hid, inter),
    }


@dataclass
class LoRAAdapter:
    """One adapter in float32: ``weights[(layer, module)] = (A [r, in], B [out, r])``,
    ``scale`` = lora_alpha / r (or / sqrt(r) with rsLoRA). ``digest``: sha256 of the
    config and weights files, the adapter's identity in block hashes."""

    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str


def _read_config(folder: Path) -> dict:
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise LoRAError(
            f"LoRA adapter {str(folder)!r} has no adapter_config.json: give a PEFT adapter "
            "folder (adapter_config.json + adapter_model.safetensors)"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise LoRAError(
            f"LoRA adapter {str(folder)!r}: adapter_config.json is not JSON ({e})"
        ) from e
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {str(folder)!r}: adapter_config.json must be an object")
    return cfg


def _check_config(folder: Path, cfg: dict, max_rank: int) -> tuple[int, float]:
    where = f"LoRA adapter {str(folder)!r}"
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{where}: peft_type {peft_type!r} is not supported, only LORA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{where}: adapter_config.json needs an integer r >= 1, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(
            f"{where}: rank r={rank} is over --max-lora-rank {max_rank}: restart with "
            f"--max-lora-rank {rank} or use an adapter of rank <= {max_rank}"
        )
    for key in ("use_dora", "fan_in_fan_out"):
        if cfg.get(key):
            raise LoRAError(f"{where}: {key}=true is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias={cfg.get('bias')!r} is not supported, only 'none'")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"{where}: modules_to_save is not supported (it replaces base weights)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise LoRAError(f"{where}: rank_pattern / alpha_pattern are not supported")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise LoRAError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scale = float(alpha) / (rank**0.5 if cfg.get("use_rslora") else rank)
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(set(targets) - set(TARGET_MODULES))
        if bad:
            raise LoRAError(
                f"{where}: target_modules {bad} are not supported; kvserve serves "
                f"{', '.join(TARGET_MODULES)}"
            )
    return rank, scale


def load_adapter(path: str, arch: ModelArchConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT folder against ``arch``; raise :class:`LoRAError` (400)
    naming the file, tensor or setting at fault. Reads only; keeps nothing open."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter path {path!r} is not a folder: give a PEFT adapter folder")
    cfg = _read_config(folder)
    rank, scale = _check_config(folder, cfg, max_rank)
    st_path = folder / "adapter_model.safetensors"
    if not st_path.is_file():
        raise LoRAError(
            f"LoRA adapter {path!r} has no adapter_model.safetensors (a .bin adapter: "
            "convert it with safetensors first)"
        )
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(st_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(
            f"LoRA adapter {path!r}: cannot read adapter_model.safetensors ({e})"
        ) from e
    shapes = module_shapes(arch)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _NAME.search(name)
        if m is None:
            raise LoRAError(
                f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA A/B weight of "
                f"{', '.join(TARGET_MODULES)}"
            )
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if layer >= arch.num_layers:
            raise LoRAError(
                f"LoRA adapter {path!r}: tensor {name!r} is for layer {layer} but the base "
                f"model has {arch.num_layers} layers: the adapter is for another model"
            )
        out_f, in_f = shapes[module]
        want = (rank, in_f) if half == "A" else (out_f, rank)
        if tuple(t.shape) != want:
            raise LoRAError(
                f"LoRA adapter {path!r}: tensor {name!r} has shape {list(t.shape)}, the base "
                f"model needs {list(want)} (r={rank}): the adapter is for another model"
            )
        halves.setdefault((layer, module), {})[half] = t.to(torch.float32).contiguous()
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAError(
                f"LoRA adapter {path!r}: layer {key[0]} {key[1]} has no {missing}.weight"
            )
        weights[key] = (pair["A"], pair["B"])
    if not weights:
        raise LoRAError(f"LoRA adapter {path!r}: adapter_model.safetensors holds no LoRA weights")
    h = hashlib.sha256()
    h.update((folder / "adapter_config.json").read_bytes())
    h.update(st_path.read_bytes())
    return LoRAAdapter(str(folder), rank, scale, weights, h.hexdigest()[:32])
