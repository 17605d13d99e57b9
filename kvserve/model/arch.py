"""The architecture facts a Llama-family model needs, parsed from an HF config.

Covers Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2 and Qwen3 (see
:mod:`kvserve.model.llama`); anything else is refused with a ValueError that says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArchConfig:
    """The architecture facts the model needs, parsed from an HF config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope_type: str
    rope_inv_freq: tuple[float, ...]
    rope_attention_scaling: float
    rope_parameters: tuple[tuple[str, Any], ...]
    max_position_embeddings: int
    max_model_len: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelArchConfig:
        """Parse a transformers config; ValueError for what this model cannot run."""
        archs = list(getattr(cfg, "architectures", None) or [])
        arch = archs[0] if archs else type(cfg).__name__.replace("Config", "ForCausalLM")
        model_type = getattr(cfg, "model_type", "")
        if model_type not in _MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported: use one of {', '.join(_MODEL_TYPES)}"
            )
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported: only 'silu' (Llama family)")
        num_heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
        qkv_bias = bool(getattr(cfg, "attention_bias", False))
        o_bias = qkv_bias
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        rope = _rope_parameters(cfg)
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(
                f"rope_type={rope_type!r} is not supported: use one of {', '.join(_STATIC_ROPE_TYPES)}"
            )
        inv_freq, attn_scaling = _rope_inv_freq(cfg, rope_type, rope, head_dim)
        max_pos = int(getattr(cfg, "max_position_embeddings", 2048))
        max_len = max_pos
        window = _sliding_window(cfg)
        if window is not None:
            max_len = min(max_len, window)  # full attention == sliding window within it
        return cls(
            architecture=arch,
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            rope_type=rope_type,
            rope_inv_freq=tuple(float(x) for x in inv_freq.tolist()),
            rope_attention_scaling=float(attn_scaling),
            rope_parameters=tuple(sorted((str(k), _plain(v)) for k, v in rope.items())),
            max_position_embeddings=max_pos,
            max_model_len=max_len,
        )

    def rope_settings(self) -> dict[str, Any]:
        """RoPE settings that change the KV (part of the model fingerprint)."""
        return {"rope_type": self.rope_type, **dict(self.rope_parameters)}


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple | list) else v


def _rope_parameters(cfg: Any) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]
        return dict(params)
    out: dict[str, Any] = {"rope_theta": float(getattr(cfg, "rope_theta", 10000.0))}
    scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(scaling, dict):
        out.update(scaling)
    return out


def _rope_inv_freq(
    cfg: Any, rope_type: str, rope: dict[str, Any], head_dim: int
) -> tuple[torch.Tensor, float]:
    if rope_type == "default":
        base = float(rope.get("rope_theta", 10000.0))
        dim = int(head_dim * float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0))
        if dim != head_dim:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def _sliding_window(cfg: Any) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    if getattr(cfg, "model_type", "") in ("qwen2", "qwen3") and not getattr(
        cfg, "use_sliding_window", False
    ):
        return None
    return window
