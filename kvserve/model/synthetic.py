"""Synthetic models of real architectures' exact shapes, with seeded random weights.

Speed does not depend on the weights' values, so a model of Llama-3.1-8B's shapes
with random weights measures what a CPU user serving Llama-3.1-8B would see, without
downloading anything. ``python -m kvserve.model.synthetic --shape NAME --format FMT``
writes one model and prints its path:

- shapes (:data:`SHAPES`): hidden size, layers, heads, KV heads, head size,
  intermediate size, vocabulary, tied embeddings, RoPE θ and scaling as the real
  configs on the Hugging Face hub;
- formats (:data:`FORMATS`): ``gguf-q4_k_m``, ``gguf-q8_0``, ``gguf-q4_0``,
  ``gguf-bf16`` (one GGUF file llama.cpp's server loads) and ``hf-bf16`` (a
  safetensors folder with config and tokenizer that vLLM and transformers load).

Rules a caller can rely on:

- The output is a pure function of ``(shape, format, seed, FORMAT_VERSION)``: it is
  written once into ``cache_dir()/synthetic/<key>`` (or ``--out``), completed by a
  ``synthetic.json`` marker written last, and reused while that marker matches.
- The tokenizer is the default model's byte-level BPE (SmolLM2's 49,152 tokens and
  merges, its chat template and special tokens), padded with ordinary tokens
  ``<|xN|>`` up to the shape's vocabulary, which is always larger: every id the model
  can emit decodes, and text tokenizes exactly as with the default model.
- Quantized tensor types follow llama.cpp's choices for the named file type: Q4_K_M
  is Q4_K with Q6_K for the output head (the embedding when tied) and for ``attn_v``
  and ``ffn_down`` in the first and last eighth of the layers and every third layer
  between; Q4_0 keeps a Q6_K head; Q8_0 is Q8_0 throughout; norms and biases are F32.
- Quantized blocks are random codes under fixed, zero-mean scales (weights of
  standard deviation ~0.02), written directly in GGUF's block layout; bf16 weights
  are seeded normals of std 0.02, the same values for ``gguf-bf16`` and ``hf-bf16``
  (llama.cpp's q/k row permutation applied in the GGUF), so the two files hold one
  model. Norm weights are 1.
- Memory while writing is one tensor at a time (the largest, an 8B embedding in
  bf16, is ~1 GB of output plus its float32 draw), so an 8B file is written on a
  24 GiB machine; data goes straight to disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

FORMAT_VERSION = 1
FORMATS = ("gguf-q4_k_m", "gguf-q8_0", "gguf-q4_0", "gguf-bf16", "hf-bf16")
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    """One architecture's shapes, as its config.json on the hub states them."""

    name: str
    arch: str  # "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float
    rms_eps: float
    max_positions: int
    rope_scaling: dict[str, Any] | None = None  # llama3 scaling parameters

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"


def _llama3(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama-3.2-1b", "llama", 2048, 16, 32, 8, 8192, 128256, True, 500000.0, 1e-5,
              131072, _llama3(32.0)),
        Shape("qwen2.5-1.5b", "qwen2", 1536, 28, 12, 2, 8960, 151936, True, 1000000.0, 1e-6,
              32768),
        Shape("llama-3.2-3b", "llama", 3072, 28, 24, 8, 8192, 128256, True, 500000.0, 1e-5,
              131072, _llama3(32.0)),
        Shape("qwen2.5-7b", "qwen2", 3584, 28, 28, 4, 18944, 152064, False, 1000000.0, 1e-6,
              32768),
        Shape("llama-3.1-8b", "llama", 4096, 32, 32, 8, 14336, 128256, False, 500000.0, 1e-5,
              131072, _llama3(8.0)),
    )
}  # fmt: skip


def linear_weights(s: Shape) -> int:
    """Weights of the linears one token passes through (its prefill FLOPs / 2),
    without the LM head."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return s.layers * (s.hidden * (q + 2 * kv) + q * s.hidden + 3 * s.hidden * s.intermediate)


# --------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class TensorSpec:
    """One weight: its HF name, GGUF name, HF shape ``[rows, cols]`` (or ``[n]``)."""

    hf: str
    gguf: str
    shape: tuple[int, ...]

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) == 2

    @property
    def is_norm(self) -> bool:
        return self.hf.endswith("norm.weight")


def tensor_specs(s: Shape) -> list[TensorSpec]:
    """Every tensor of the model, in the order llama.cpp's converter writes them."""
    d, hd = s.hidden, s.head_dim
    q, kv = s.heads * hd, s.kv_heads * hd
    out = [TensorSpec("model.embed_tokens.weight", "token_embd.weight", (s.vocab, d))]
    for i in range(s.layers):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        out.append(TensorSpec(p + "input_layernorm.weight", g + "attn_norm.weight", (d,)))
        for hf, gg, rows in (
            ("q_proj", "attn_q", q),
            ("k_proj", "attn_k", kv),
            ("v_proj", "attn_v", kv),
        ):
            out.append(TensorSpec(f"{p}self_attn.{hf}.weight", f"{g}{gg}.weight", (rows, d)))
            if s.qkv_bias:
                out.append(TensorSpec(f"{p}self_attn.{hf}.bias", f"{g}{gg}.bias", (rows,)))
        out.append(TensorSpec(p + "self_attn.o_proj.weight", g + "attn_output.weight", (d, q)))
        out.append(TensorSpec(p + "post_attention_layernorm.weight", g + "ffn_norm.weight", (d,)))
        out.append(
            TensorSpec(p + "mlp.gate_proj.weight", g + "ffn_gate.weight", (s.intermediate, d))
        )
        out.append(TensorSpec(p + "mlp.up_proj.weight", g + "ffn_up.weight", (s.intermediate, d)))
        out.append(
            TensorSpec(p + "mlp.down_proj.weight", g + "ffn_down.weight", (d, s.intermediate))
        )
    out.append(TensorSpec("model.norm.weight", "output_norm.weight", (d,)))
    if not s.tied:
        out.append(TensorSpec("lm_head.weight", "output.weight", (s.vocab, d)))
    return out


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: first and last eighth, and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def gguf_type(fmt: str, spec: TensorSpec, s: Shape) -> str:
    """The GGUF tensor type of ``spec`` in file type ``fmt`` (llama.cpp's choice)."""
    if not spec.is_matrix:
        return "F32"
    if fmt == "gguf-bf16":
        return "BF16"
    if fmt == "gguf-q8_0":
        return "Q8_0"
    head = spec.gguf == "output.weight" or (s.tied and spec.gguf == "token_embd.weight")
    if head:
        return "Q6_K"
    if fmt == "gguf-q4_0":
        return "Q4_0"
    # Q4_K_M
    layer = int(spec.gguf.split(".")[1]) if spec.gguf.startswith("blk.") else -1
    if (".attn_v." in spec.gguf or ".ffn_down." in spec.gguf) and _more_bits(layer, s.layers):
        return "Q6_K"
    return "Q4_K"


# GGUF type codes and block geometry (values per block, bytes per block)
_TYPE_CODES = {"F32": 0, "Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14, "BF16": 30}
_BLOCKS = {"F32": (1, 4), "BF16": (1, 2), "Q4_0": (32, 18), "Q8_0": (32, 34),
           "Q4_K": (256, 144), "Q6_K": (256, 210)}  # fmt: skip
_FILE_TYPES = {"gguf-q4_k_m": 15, "gguf-q8_0": 7, "gguf-q4_0": 2, "gguf-bf16": 32}


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}|{name}".encode()).digest()[:8], "little")


def _bf16_normal(rng: np.random.Generator, n: int) -> np.ndarray:
    """n bf16 values (as uint16) of N(0, WEIGHT_STD²), rounded to nearest even."""
    x = rng.standard_normal(n, dtype=np.float32)
    x *= WEIGHT_STD
    u = x.view(np.uint32)
    u += 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


def _fp16(v: float) -> np.ndarray:
    return np.array([v], dtype=np.float16).view(np.uint8)


def _quant_blocks(rng: np.random.Generator, type_name: str, n_values: int) -> np.ndarray:
    """Random blocks of a quantized type, as bytes: random codes, fixed zero-mean
    scales giving weights of std ~WEIGHT_STD."""
    per, size = _BLOCKS[type_name]
    nb = n_values // per
    b = np.frombuffer(rng.bytes(nb * size), dtype=np.uint8).reshape(nb, size).copy()
    if type_name == "Q8_0":  # d (fp16), 32 x int8; int8 uniform: std 73.9
        b[:, 0:2] = _fp16(WEIGHT_STD / 73.9)
    elif type_name == "Q4_0":  # d, 16 bytes of nibbles; w = d * (q - 8), std 4.61 d
        b[:, 0:2] = _fp16(WEIGHT_STD / 4.61)
    elif type_name == "Q4_K":
        # d, dmin, 12 bytes of 6-bit (scale, min) pairs, 128 bytes of nibbles; every
        # sub-block scale = min = 32: w = 32 d u - 32 dmin, zero mean when dmin = 7.5 d
        d = WEIGHT_STD / (32 * 4.61)
        b[:, 0:2] = _fp16(d)
        b[:, 2:4] = _fp16(7.5 * d)
        b[:, 4:12] = 160  # low 6 bits 32 (scale / min of sub-blocks 0-3), top bits: 32 >> 4
        b[:, 12:16] = 0  # low nibbles of sub-blocks 4-7's 32: 0
    elif type_name == "Q6_K":
        # 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, d (fp16);
        # w = d * sc * (q - 32), q uniform in [0, 64): std 18.5 sc d
        b[:, 192:208] = 8
        b[:, 208:210] = _fp16(WEIGHT_STD / (8 * 18.5))
    else:
        raise ValueError(f"no random blocks for {type_name}")
    return b.reshape(-1)


def _permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a llama-architecture q/k weight (its RoPE layout)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def tensor_data(
    spec: TensorSpec, type_name: str, s: Shape, seed: int, gguf_order: bool
) -> np.ndarray:
    """The bytes of one tensor (a flat uint8 / uint16 / float32 array). Values depend
    only on (seed, HF name) and the type, so both bf16 formats hold one model."""
    rng = np.random.default_rng(_seed_of(seed, spec.hf))
    n = math.prod(spec.shape)
    if type_name == "F32":
        if spec.is_norm:
            return np.ones(n, dtype=np.float32)
        return (rng.standard_normal(n, dtype=np.float32) * WEIGHT_STD).astype(np.float32)
    if type_name == "BF16":
        w = _bf16_normal(rng, n)
        if gguf_order and s.arch == "llama" and spec.is_matrix:
            if ".q_proj." in spec.hf:
                w = _permute_qk(w.reshape(spec.shape), s.heads).reshape(-1)
            elif ".k_proj." in spec.hf:
                w = _permute_qk(w.reshape(spec.shape), s.kv_heads).reshape(-1)
        return w
    return _quant_blocks(rng, type_name, n)


def llama3_rope_factors(s: Shape) -> np.ndarray:
    """The ``rope_freqs`` factors llama.cpp's converter stores for llama3 scaling."""
    assert s.rope_scaling is not None
    sc = s.rope_scaling
    dim = s.head_dim
    freqs = 1.0 / (s.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    old = sc["original_max_position_embeddings"]
    low_wl, high_wl = old / sc["low_freq_factor"], old / sc["high_freq_factor"]
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(sc["factor"])
        else:
            smooth = (old / wl - sc["low_freq_factor"]) / (
                sc["high_freq_factor"] - sc["low_freq_factor"]
            )
            out.append(1.0 / ((1 - smooth) / sc["factor"] + smooth))
    return np.array(out, dtype=np.float32)


# --------------------------------------------------------------------------- tokenizer


@dataclass
class BaseTokenizer:
    """The default model's tokenizer: GGUF arrays and HF files."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    meta: dict[str, Any]  # bos/eos/unknown/padding ids, pre, chat_template, add_bos
    hf_folder: Path  # tokenizer.json and friends


def _extra_token(i: int) -> str:
    return f"<|x{i}|>"


def load_base_tokenizer() -> BaseTokenizer:
    """Read the default model's tokenizer from its shipped GGUF file (no download)."""
    from gguf import GGUFReader

    from kvserve.model.loader import DEFAULT_MODEL_NAME, _named_gguf_path, resolve_gguf_metadata

    path = _named_gguf_path(DEFAULT_MODEL_NAME)
    fields = GGUFReader(path).fields
    meta: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
                "add_bos_token", "add_space_prefix", "pre", "model"):  # fmt: skip
        if f"tokenizer.ggml.{key}" in fields:
            meta[key] = fields[f"tokenizer.ggml.{key}"].contents()
    if "tokenizer.chat_template" in fields:
        meta["chat_template"] = fields["tokenizer.chat_template"].contents()
    return BaseTokenizer(
        tokens=list(fields["tokenizer.ggml.tokens"].contents()),
        token_types=[int(t) for t in fields["tokenizer.ggml.token_type"].contents()],
        merges=list(fields["tokenizer.ggml.merges"].contents()),
        meta=meta,
        hf_folder=resolve_gguf_metadata(path, DEFAULT_MODEL_NAME),
    )


def write_hf_tokenizer(base: BaseTokenizer, vocab: int, out: Path) -> None:
    """The default tokenizer's files, its BPE vocabulary padded to ``vocab`` ids."""
    for f in base.hf_folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) and f.is_file():
            shutil.copy(f, out / f.name)
    tj = json.loads((out / "tokenizer.json").read_text())
    v = tj["model"]["vocab"]
    n0 = len(base.tokens)
    if max(v.values()) >= n0:
        raise ValueError("the default tokenizer's vocabulary is larger than expected")
    for i in range(n0, vocab):
        v[_extra_token(i)] = i
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))


# --------------------------------------------------------------------------- GGUF writer


def _gguf_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _gguf_value(v: Any) -> tuple[int, bytes]:
    """(type code, payload) of one metadata value."""
    if isinstance(v, bool):
        return 7, struct.pack("<?", v)
    if isinstance(v, int):
        return 4, struct.pack("<I", v)
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    if isinstance(v, str):
        return 8, _gguf_string(v)
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            return 9, struct.pack("<IQ", 8, len(v)) + b"".join(_gguf_string(x) for x in v)
        if all(isinstance(x, int) for x in v):
            return 9, struct.pack("<IQ", 5, len(v)) + np.asarray(v, dtype="<i4").tobytes()
    raise TypeError(f"unsupported GGUF metadata value {v!r}")


def gguf_metadata(s: Shape, fmt: str, base: BaseTokenizer) -> dict[str, Any]:
    """The file's key/value metadata, as llama.cpp's converter writes it."""
    a = s.arch
    n0 = len(base.tokens)
    tokens = base.tokens + [_extra_token(i) for i in range(n0, s.vocab)]
    types = base.token_types + [1] * (s.vocab - n0)  # 1: normal
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.type": "model",
        "general.name": f"kvserve synthetic {s.name}",
        "general.file_type": _FILE_TYPES[fmt],
        "general.quantization_version": 2,
        f"{a}.context_length": s.max_positions,
        f"{a}.embedding_length": s.hidden,
        f"{a}.block_count": s.layers,
        f"{a}.feed_forward_length": s.intermediate,
        f"{a}.attention.head_count": s.heads,
        f"{a}.attention.head_count_kv": s.kv_heads,
        f"{a}.attention.layer_norm_rms_epsilon": s.rms_eps,
        f"{a}.rope.freq_base": s.rope_theta,
        f"{a}.rope.dimension_count": s.head_dim,
        f"{a}.vocab_size": s.vocab,
        "tokenizer.ggml.model": base.meta.get("model", "gpt2"),
        "tokenizer.ggml.pre": base.meta.get("pre", "smollm"),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": base.merges,
    }
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        if key in base.meta:
            md[f"tokenizer.ggml.{key}"] = int(base.meta[key])
    for key in ("add_bos_token", "add_space_prefix"):
        if key in base.meta:
            md[f"tokenizer.ggml.{key}"] = bool(base.meta[key])
    if "chat_template" in base.meta:
        md["tokenizer.chat_template"] = str(base.meta["chat_template"])
    return md


def _pad(f: BinaryIO, align: int) -> None:
    pos = f.tell()
    if pos % align:
        f.write(b"\0" * (align - pos % align))


def write_gguf(s: Shape, fmt: str, seed: int, base: BaseTokenizer, path: Path,
               progress: Callable[[str], None]) -> None:  # fmt: skip
    """One GGUF v3 file: header, metadata, tensor table, then each tensor's data,
    generated and written one at a time (32-byte aligned)."""
    align = 32
    tensors: list[tuple[str, tuple[int, ...], str, Callable[[], np.ndarray]]] = []
    if s.arch == "llama" and s.rope_scaling is not None:
        factors = llama3_rope_factors(s)
        tensors.append(("rope_freqs.weight", (factors.size,), "F32", lambda: factors))
    for spec in tensor_specs(s):
        t = gguf_type(fmt, spec, s)

        def gen(spec: TensorSpec = spec, t: str = t) -> np.ndarray:
            return tensor_data(spec, t, s, seed, gguf_order=True)

        tensors.append((spec.gguf, spec.shape, t, gen))
    md = gguf_metadata(s, fmt, base)
    sizes = []
    for _, shape, t, _ in tensors:
        per, size = _BLOCKS[t]
        if shape[-1] % per:
            raise ValueError(f"row of {shape[-1]} values is not a multiple of {t}'s {per}")
        sizes.append(math.prod(shape) // per * size)
    total = sum(sizes)
    t0 = time.monotonic()
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(md)))
        for k, v in md.items():
            code, payload = _gguf_value(v)
            f.write(_gguf_string(k) + struct.pack("<I", code) + payload)
        offset = 0
        for (name, shape, t, _), size in zip(tensors, sizes, strict=True):
            ne = tuple(reversed(shape))  # GGUF lists the fastest-varying dim first
            f.write(_gguf_string(name) + struct.pack("<I", len(ne)))
            f.write(struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", _TYPE_CODES[t], offset))
            offset += size + (-size) % align
        _pad(f, align)
        done = 0
        for (name, _, _, produce), size in zip(tensors, sizes, strict=True):
            data = produce()
            if data.nbytes != size:
                raise AssertionError(f"{name}: {data.nbytes} bytes, expected {size}")
            f.write(data.tobytes())
            _pad(f, align)
            done += size
            progress(f"{done / total:6.1%} of {total / 2**30:.2f} GiB  {name}  "
                     f"({time.monotonic() - t0:.0f} s)")  # fmt: skip


# --------------------------------------------------------------------------- HF folder


def hf_config(s: Shape, base: BaseTokenizer) -> dict[str, Any]:
    """config.json of the HF folder (transformers' and vLLM's field names)."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if s.arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": s.arch,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab,
        "max_position_embeddings": s.max_positions,
        "rms_norm_eps": s.rms_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": s.rope_scaling,
        "tie_word_embeddings": s.tied,
        "hidden_act": "silu",
        "initializer_range": WEIGHT_STD,
        "bos_token_id": int(base.meta.get("bos_token_id", 1)),
        "eos_token_id": int(base.meta.get("eos_token_id", 2)),
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    if s.arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=s.layers,
                   attention_dropout=0.0)  # fmt: skip
    return cfg


def write_hf(s: Shape, seed: int, base: BaseTokenizer, out: Path,
             progress: Callable[[str], None], shard_bytes: int = 4 << 30) -> None:  # fmt: skip
    """A safetensors folder in shards of at most ``shard_bytes`` (bf16; norms and
    biases in bf16 too, as the hub's bf16 checkpoints), with index, config and
    tokenizer. Each shard is written tensor by tensor."""
    specs = tensor_specs(s)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        n = math.prod(spec.shape) * 2
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    total = sum(math.prod(sp.shape) * 2 for sp in specs)
    weight_map: dict[str, str] = {}
    done, t0 = 0, time.monotonic()
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for spec in shard:
            n = math.prod(spec.shape) * 2
            header[spec.hf] = {
                "dtype": "BF16",
                "shape": list(spec.shape),
                "data_offsets": [off, off + n],
            }
            off += n
            weight_map[spec.hf] = fname
        hb = json.dumps(header).encode()
        hb += b" " * ((-len(hb)) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            for spec in shard:
                if spec.is_norm:
                    data = np.full(math.prod(spec.shape), 0x3F80, dtype=np.uint16)  # 1.0
                else:
                    data = tensor_data(spec, "BF16", s, seed, gguf_order=False)
                f.write(data.tobytes())
                done += data.nbytes
                progress(f"{done / total:6.1%} of {total / 2**30:.2f} GiB  {spec.hf}  "
                         f"({time.monotonic() - t0:.0f} s)")  # fmt: skip
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(s, base), indent=2))
    gen = {"bos_token_id": int(base.meta.get("bos_token_id", 1)),
           "eos_token_id": int(base.meta.get("eos_token_id", 2))}  # fmt: skip
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    write_hf_tokenizer(base, s.vocab, out)


# --------------------------------------------------------------------------- entry point


def cache_key(shape: str, fmt: str, seed: int) -> str:
    """The cache folder's name for these arguments."""
    return f"{shape}-{fmt}-seed{seed}-v{FORMAT_VERSION}"


def default_out(shape: str, fmt: str, seed: int) -> Path:
    """``cache_dir()/synthetic/<cache_key>``."""
    from kvserve.model.model_files import cache_dir

    return cache_dir() / "synthetic" / cache_key(shape, fmt, seed)


def model_path(folder: Path, fmt: str) -> Path:
    """What to pass as ``--model``: the GGUF file in ``folder``, or the folder."""
    return folder / "model.gguf" if fmt.startswith("gguf-") else folder


def generate(shape: str, fmt: str, seed: int = 0, out: Path | None = None,
             progress: Callable[[str], None] | None = None) -> Path:  # fmt: skip
    """Write (once) the synthetic model and return :func:`model_path` of it.

    Raises ValueError for an unknown shape or format, or when ``out`` holds a
    different model (its marker names other arguments).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    folder = Path(out) if out is not None else default_out(shape, fmt, seed)
    marker = folder / "synthetic.json"
    want = {"shape": asdict(SHAPES[shape]), "format": fmt, "seed": seed, "version": FORMAT_VERSION}
    if marker.is_file():
        have = json.loads(marker.read_text())
        if have == want:
            return model_path(folder, fmt)
        raise ValueError(f"{str(folder)!r} holds another synthetic model ({have.get('shape', {}).get('name')}, "
                         f"{have.get('format')}, seed {have.get('seed')}): pass another --out")  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda msg: None)
    s = SHAPES[shape]
    base = load_base_tokenizer()
    if fmt == "hf-bf16":
        write_hf(s, seed, base, folder, report)
    else:
        tmp = folder / "model.gguf.tmp"
        write_gguf(s, fmt, seed, base, tmp, report)
        os.replace(tmp, folder / "model.gguf")
    marker.write_text(json.dumps(want, indent=2))
    return model_path(folder, fmt)


def _stderr_progress() -> Callable[[str], None]:
    last = [0.0]

    def show(msg: str) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0 or msg.startswith("100.0%"):
            last[0] = now
            print(f"\rkvserve synthetic: {msg:<100.100}", end="", file=sys.stderr, flush=True)

    return show


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvserve.model.synthetic",
        description="Write a model of a real architecture's shapes with seeded random weights.",
    )
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: a cache folder keyed by the arguments)")  # fmt: skip
    a = p.parse_args(argv)
    try:
        path = generate(a.shape, a.format, a.seed, a.out, _stderr_progress())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(file=sys.stderr)
    print(path)
    return 0


def iter_shapes() -> Iterator[Shape]:
    """The shapes, smallest first."""
    return iter(sorted(SHAPES.values(), key=lambda s: s.hidden * s.layers))


if __name__ == "__main__":
    raise SystemExit(main())
