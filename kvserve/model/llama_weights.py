"""Copying a checkpoint's HF-named tensors into :class:`~kvserve.model.llama_params.LlamaParams`'
fused parameters (``qkv_proj`` = [q; k; v], ``gate_up_proj`` = [gate; up]), keeping
quantized tensors (:class:`~kvserve.model.quant.formats.QuantWeight`) quantized."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvserve.model.llama_params import LlamaParams
from kvserve.model.quant.formats import QuantWeight


def load_llama_weights(
    model: LlamaParams,
    tensors: Iterable[tuple[str, torch.Tensor | QuantWeight]],
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, list[QuantWeight]]:
    """Fill ``model``'s parameters from ``tensors`` (HF names) in ``dtype`` on ``device``.

    Returns the quantized weights by parameter name (``"embed_tokens"``, ``"lm_head"``,
    ``"layers.3.qkv_proj"``; their parameter becomes an empty placeholder of the model
    dtype). Fused q/k/v or gate/up parts of different formats stay separate row blocks;
    a fused weight mixing float and quantized parts is dequantized. Raises ValueError
    for a missing tensor, a wrong shape, or tensors the architecture does not use.
    """
    c = model.config
    src = dict(tensors)
    used: set[str] = set()
    quant: dict[str, list[QuantWeight]] = {}

    def take(name: str) -> torch.Tensor | QuantWeight:
        if name not in src:
            raise ValueError(f"checkpoint lacks tensor {name!r} needed by {c.architecture}")
        used.add(name)
        return src[name]

    def dense(name: str) -> torch.Tensor:
        value = take(name)
        return value.dequantize() if isinstance(value, QuantWeight) else value

    def cat(values: list[torch.Tensor | QuantWeight]) -> torch.Tensor | list[QuantWeight]:
        quant = [v for v in values if isinstance(v, QuantWeight)]
        if len(quant) < len(values):
            plain = [v.dequantize() if isinstance(v, QuantWeight) else v for v in values]
            return torch.cat(plain, 0)
        parts: list[QuantWeight] = []
        for v in quant:  # neighbours of one format become one block
            if parts and parts[-1].fmt == v.fmt:
                parts[-1] = QuantWeight.cat([parts[-1], v])
            else:
                parts.append(v)
        return parts

    def put(
        param: nn.Parameter | None,
        value: torch.Tensor | QuantWeight | list[QuantWeight],
        name: str,
        key: str | None = None,
    ) -> None:
        assert param is not None
        if isinstance(value, QuantWeight):
            value = [value]
        shape: tuple[int, ...]
        if isinstance(value, list):
            shape = (sum(v.n for v in value), value[0].k)
        else:
            shape = tuple(value.shape)
        if tuple(param.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {shape}, expected {tuple(param.shape)}")
        if isinstance(value, list):
            assert key is not None, f"{name} cannot be quantized"
            quant[key] = value
            param.data = torch.empty(0, param.shape[1], device=device, dtype=dtype)
        else:
            data = value.to(device=device, dtype=dtype).contiguous()
            if data.dim() == 1:  # norms, biases: own memory, never a view that pins a
                data = data.clone()  # whole mmap'd checkpoint once the big weights are packed
            param.data = data

    embed = take("model.embed_tokens.weight")
    put(model.embed_tokens, embed, "model.embed_tokens.weight", "embed_tokens")
    put(model.norm, dense("model.norm.weight"), "model.norm.weight")
    if model.lm_head is not None:
        put(model.lm_head, take("lm_head.weight"), "lm_head.weight", "lm_head")
    else:
        used.add("lm_head.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        q = f"layers.{i}."
        put(layer.input_layernorm, dense(p + "input_layernorm.weight"), p + "input_layernorm")
        put(
            layer.post_attention_layernorm,
            dense(p + "post_attention_layernorm.weight"),
            p + "post_attention_layernorm",
        )
        qkv = cat([take(f"{a}{x}_proj.weight") for x in "qkv"])
        put(layer.qkv_proj, qkv, a + "qkv_proj", q + "qkv_proj")
        if c.qkv_bias:
            put(
                layer.qkv_bias,
                torch.cat([dense(f"{a}{x}_proj.bias") for x in "qkv"]),
                a + "qkv_bias",
            )
        put(layer.o_proj, take(a + "o_proj.weight"), a + "o_proj.weight", q + "o_proj")
        if c.o_bias:
            put(layer.o_bias, dense(a + "o_proj.bias"), a + "o_proj.bias")
        if c.qk_norm:
            qn, kn = dense(a + "q_norm.weight"), dense(a + "k_norm.weight")
            norm = torch.cat([qn.expand(c.num_heads, -1), kn.expand(c.num_kv_heads, -1)])
            put(layer.qk_norm, norm, a + "qk_norm")
        gate_up = cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        put(layer.gate_up_proj, gate_up, m + "gate_up_proj", q + "gate_up_proj")
        down = take(m + "down_proj.weight")
        put(layer.down_proj, down, m + "down_proj.weight", q + "down_proj")
        if c.mlp_bias:
            gu_bias = torch.cat([dense(m + "gate_proj.bias"), dense(m + "up_proj.bias")])
            put(layer.gate_up_bias, gu_bias, m + "gate_up_bias")
            put(layer.down_bias, dense(m + "down_proj.bias"), m + "down_proj.bias")
    unexpected = sorted(k for k in src if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(
            f"checkpoint has tensors {c.architecture} does not use: {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )
    return quant
