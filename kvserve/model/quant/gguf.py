"""Read a GGUF file's tensors as they are: quantized blocks become
:class:`~kvserve.model.quant.formats.QuantWeight` panels (repacked once, in memory,
never through a float copy on disk); float tensors become torch tensors; tensor types
without a kernel here are dequantized to float32 (that one tensor runs in float).

Names are mapped onto the Hugging Face names ``LlamaForCausalLM.load_weights``
expects, and llama.cpp's row order of q/k in llama-architecture files (permuted for its
RoPE) is undone, as transformers' GGUF loader does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.model.quant.formats import (
    BLOCK,
    Q4_0,
    Q4_1,
    Q8_0,
    QuantWeight,
)

if TYPE_CHECKING:
    from kvserve.model.quant.kernel import QuantKernel

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SKIPPED = ("rope_freqs",)  # RoPE frequencies come from the config, as in transformers
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for
    tensors kvserve does not load (RoPE frequency tables); ValueError for unknown ones."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _SKIPPED:
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama-family counterpart")


def _from_blocks(raw: np.ndarray, type_name: str, n: int, k: int) -> QuantWeight:
    """Raw GGUF rows [n, row_bytes] of Q4_0 / Q4_1 / Q8_0 -> panels."""
    nb = k // BLOCK
    if type_name == "Q8_0":
        b = torch.from_numpy(np.array(raw).reshape(n, nb, 34))
        d = b[:, :, :2].contiguous().view(torch.float16).view(n, nb)
        q = b[:, :, 2:].contiguous().view(torch.int8).to(torch.int16)
        return QuantWeight.pack((q + 128).to(torch.uint8).view(n, k), d, None, Q8_0, "gguf:Q8_0")
    size = 20 if type_name == "Q4_1" else 18
    b = torch.from_numpy(np.array(raw).reshape(n, nb, size))
    d = b[:, :, :2].contiguous().view(torch.float16).view(n, nb)
    m = b[:, :, 2:4].contiguous().view(torch.float16).view(n, nb) if size == 20 else None
    qs = b[:, :, size - 16 :]
    u = torch.cat([qs & 15, qs >> 4], -1).view(n, k)  # byte j: value j (low), j + 16 (high)
    fmt = Q4_1 if size == 20 else Q4_0
    return QuantWeight.pack(u, d, m, fmt, f"gguf:{type_name}")


def _from_kquant(
    raw: np.ndarray, type_name: str, n: int, k: int, kernel: QuantKernel | None = None
) -> QuantWeight:
    """Raw Q4_K / Q5_K / Q6_K rows -> K-quant panels holding the file's integers and
    scales unchanged (:mod:`kvserve.model.quant.kquant`; exact, about the file's size)."""
    from kvserve.model.quant.kquant import from_gguf

    return from_gguf(raw, type_name, n, k, kernel)


def _unpermute_index(n: int, heads: int) -> torch.Tensor:
    """Rows of a llama.cpp-permuted q/k weight in HF order (transformers'
    ``reverse_permute_weights`` applied to the row indices)."""
    idx = torch.arange(n)
    return idx.view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


def read_tensors(
    path: Path,
    num_heads: int,
    num_kv_heads: int,
    keep_quantized: bool = True,
    kernel: QuantKernel | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """(HF name, tensor) for every tensor of the GGUF file at ``path``.

    ``keep_quantized``: Q4_0/Q4_1/Q8_0 tensors come as QuantWeight, Q4_K/Q5_K/Q6_K as
    :class:`~kvserve.model.quant.kquant.KQuantWeight` (exact); otherwise (and for every
    other quantized type) as float32 dequantized by the gguf package. ``kernel`` (the
    backend's ``quant_linear``) repacks K-quant super-blocks in C; None: in NumPy (same bytes).
    """
    from gguf.quants import dequantize

    from kvserve.model.quant.gguf_file import read_gguf

    gf = read_gguf(path)
    arch = gf.string("general.architecture")
    for t in gf.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        type_name = t.tensor_type.name
        shape = [int(s) for s in reversed(t.shape)]  # GGUF lists ne0 (k) first
        value: torch.Tensor | QuantWeight
        if type_name in ("F32", "F16", "BF16"):
            arr = np.asarray(t.data)
            if type_name == "BF16":
                value = torch.from_numpy(arr.copy()).view(torch.bfloat16).float()
            else:
                value = torch.from_numpy(arr.astype(np.float32))
            value = value.reshape(shape)
        elif keep_quantized and type_name in NATIVE_TYPES[:3] and len(shape) == 2:
            value = _from_blocks(np.asarray(t.data), type_name, shape[0], shape[1])
        elif keep_quantized and type_name in NATIVE_TYPES and len(shape) == 2:
            value = _from_kquant(np.asarray(t.data), type_name, shape[0], shape[1], kernel)
        else:
            arr = dequantize(np.asarray(t.data), t.tensor_type)
            value = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            index = _unpermute_index(shape[0], heads)
            value = value.select_rows(index) if isinstance(value, QuantWeight) else value[index]
        yield name, value
