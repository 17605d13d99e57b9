"""Read int4 Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors ``pack-quantized``)
into the 4-bit panels of :mod:`kvserve.model.quant.formats`, without a float copy.

Detected from ``config.json``'s ``quantization_config`` (``quant_method`` ``gptq``,
``awq`` or ``compressed-tensors``). Layouts read (4 bits, group size a multiple of 32,
or -1 / per channel):

- **GPTQ** (AutoGPTQ / GPTQModel): ``qweight`` int32 [in/8, out] (input i*8+t at bits
  4t of row i), ``qzeros`` int32 [groups, out/8] (column j*8+t at bits 4t; the
  ``gptq`` checkpoint format stores zero - 1, ``gptq_v2`` the zero), ``scales`` fp16
  [groups, out], optional ``g_idx`` int32 [in] (the group of each input);
  ``w = scale * (q - zero)``.
- **AWQ** (AutoAWQ GEMM): ``qweight`` int32 [in, out/8] and ``qzeros`` [groups, out/8]
  packed along the output with AWQ's nibble order (slot s of a word holds column
  ``[0, 2, 4, 6, 1, 3, 5, 7][s]``), ``scales`` [groups, out]; groups contiguous;
  ``w = scale * (q - zero)``.
- **compressed-tensors** ``pack-quantized``: ``weight_packed`` int32 [out, in/8]
  (input c*8+t at bits 4t), values stored as ``q + 8`` (q signed), ``weight_scale``
  [out, groups], optional ``weight_zero_point`` ([out, groups] int, or packed int32
  [out/8, groups]) and ``weight_g_idx``; ``w = scale * (q - zero_point)``.

Target format: symmetric weights whose zero is 8 everywhere (GPTQ ``sym``, every
symmetric compressed-tensors file) become q4_0 exactly (same integers, the fp16 scale
unchanged; a bf16 scale is converted to fp16 and checked exact). Weights with zero
points become q4_1 (``w = d * u + m``, ``d`` the scale, ``m = -scale * zero`` rounded to
fp16: off by at most 2**-11 of ``|m|``, below 1 % of a quantization step).

Act-order (``g_idx`` not in group order): the input columns are reordered at load so
each group is contiguous (stable sort by group), and the weight keeps the permutation
(:attr:`QuantWeight.in_perm`); the linear gathers its input columns in that order
before the kernel (one ``index_select`` of the activations per call). Fused parts (q/k/v,
gate/up) must then share the permutation, as GPTQ produces (same inputs, same
Hessian order); otherwise loading fails with a clear error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvserve.model.quant.formats import BLOCK, Q4_0, Q4_1, QuantWeight

METHODS = ("gptq", "awq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of nibble slot s within a packed word
_PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": (
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_g_idx",
        "weight_shape",
    ),
}


def quantization_config(folder: Path) -> dict[str, Any] | None:
    """``config.json``'s ``quantization_config`` (None when absent or unreadable)."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = cfg.get("quantization_config")
    return q if isinstance(q, dict) else None


def detect(folder: Path) -> dict[str, Any] | None:
    """The folder's int4 scheme as ``{"method", "bits", "group_size", "sym", "format"}``,
    or None for an unquantized folder. Raises ValueError (saying what is supported) for a
    quantization this reader does not handle."""
    q = quantization_config(folder)
    if q is None:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(
            f"{folder}: quantization_config.quant_method {method!r} is not supported; "
            f"kvserve reads {', '.join(METHODS)} int4 folders (or pass a float checkpoint)"
        )
    if method == "compressed-tensors":
        fmt = q.get("format", "")
        groups = q.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values()]
        if fmt != "pack-quantized" or not weights:
            raise ValueError(
                f"{folder}: compressed-tensors format {fmt!r} is not supported; kvserve "
                f"reads 'pack-quantized' int4 weights"
            )
        w0 = weights[0]
        if any(w != w0 for w in weights) or w0.get("num_bits") != 4 or w0.get("type") != "int":
            raise ValueError(f"{folder}: compressed-tensors needs one 4-bit int weight scheme")
        return {
            "method": method,
            "bits": 4,
            "group_size": int(w0.get("group_size") or -1),
            "sym": bool(w0.get("symmetric", True)),
            "format": fmt,
        }
    bits = int(q.get("bits", q.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"{folder}: {method} with {bits} bits is not supported (4 bits only)")
    return {
        "method": method,
        "bits": 4,
        "group_size": int(q.get("group_size", q.get("q_group_size", 128))),
        "sym": bool(q.get("sym", False)),
        "format": str(q.get("checkpoint_format", q.get("version", ""))).lower(),
    }


# --------------------------------------------------------------------------- unpacking


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> uint8 nibbles, 8 per word along ``dim`` (nibble t at bits 4t)."""
    p = packed.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = ((p.unsqueeze(-1) >> shifts) & 15).reshape(*p.shape[:-1], -1)
    return nib.to(torch.uint8).movedim(-1, dim).contiguous()


def _groups_to_blocks(
    u: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    name: str,
    source: str,
) -> QuantWeight:
    """u [out, in] uint8, scales / zeros [out, groups], g_idx [in] -> q4_0 / q4_1 panels
    (input columns reordered by group when g_idx is not already in order)."""
    n, k = u.shape
    if k % BLOCK:
        raise ValueError(f"{name}: {k} inputs; int4 checkpoints need a multiple of {BLOCK}")
    g_idx = g_idx.to(torch.int64)
    perm: torch.Tensor | None = None
    if bool((g_idx[1:] < g_idx[:-1]).any()):  # act-order: make each group contiguous
        perm = torch.sort(g_idx, stable=True).indices
        u, g_idx = u[:, perm], g_idx[perm]
    gb = g_idx.view(-1, BLOCK)
    if not bool((gb == gb[:, :1]).all()):
        raise ValueError(
            f"{name}: quantization groups do not fill whole blocks of {BLOCK} inputs "
            f"(group size must be a multiple of {BLOCK})"
        )
    block_group = gb[:, 0]  # [k/32]
    s = scales[:, block_group]  # [out, k/32]
    z = zeros[:, block_group].to(torch.int32)
    s16 = s.to(torch.float16)
    if not torch.equal(s16.to(s.dtype), s):
        raise ValueError(f"{name}: scales do not fit fp16 exactly (kvserve's int4 scale type)")
    if bool((z == 8).all()):
        w = QuantWeight.pack(u, s16, None, Q4_0, source)
    else:
        m = (-(s.float() * z.float())).to(torch.float16)
        w = QuantWeight.pack(u, s16, m, Q4_1, source)
    w.in_perm = perm
    return w


def convert_gptq(parts: dict[str, torch.Tensor], scheme: dict[str, Any], name: str) -> QuantWeight:
    """GPTQ tensors of one linear (qweight, qzeros, scales, optional g_idx) -> panels."""
    q = unpack_int32(parts["qweight"], 0)  # [in, out]
    k, n = q.shape
    zeros = unpack_int32(parts["qzeros"], 1)[:, :n].to(torch.int32)  # [groups, out]
    if scheme["format"] != "gptq_v2":
        zeros = zeros + 1  # the v1 format stores zero - 1 (AutoGPTQ adds 1 back)
    scales = parts["scales"]
    gs = scheme["group_size"] if scheme["group_size"] > 0 else k
    g_idx = parts.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // gs
    return _groups_to_blocks(q.T.contiguous(), scales.T, zeros.T, g_idx, name, "gptq")


def convert_awq(parts: dict[str, torch.Tensor], scheme: dict[str, Any], name: str) -> QuantWeight:
    """AWQ GEMM tensors of one linear (qweight, qzeros, scales) -> panels."""
    reverse = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])

    def unpack_cols(p: torch.Tensor) -> torch.Tensor:  # [r, out/8] -> [r, out] in column order
        nib = unpack_int32(p, 1).view(p.shape[0], -1, 8)
        return nib[:, :, reverse].reshape(p.shape[0], -1)

    q = unpack_cols(parts["qweight"])  # [in, out]
    k, n = q.shape
    zeros = unpack_cols(parts["qzeros"])[:, :n]
    gs = scheme["group_size"] if scheme["group_size"] > 0 else k
    g_idx = torch.arange(k) // gs
    return _groups_to_blocks(q.T.contiguous(), parts["scales"].T, zeros.T, g_idx, name, "awq")


def convert_compressed(
    parts: dict[str, torch.Tensor], scheme: dict[str, Any], name: str
) -> QuantWeight:
    """compressed-tensors pack-quantized tensors of one linear -> panels."""
    u = unpack_int32(parts["weight_packed"], 1)  # [out, in (padded to 8)]
    if "weight_shape" in parts:
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        u = u[:n, :k]
    n, k = u.shape
    scales = parts["weight_scale"]
    if scales.dim() == 1:
        scales = scales.view(-1, 1)
    groups = scales.shape[1]
    zp = parts.get("weight_zero_point")
    if zp is None or scheme["sym"]:
        zeros = torch.full((n, groups), 8, dtype=torch.int32)
    else:
        if zp.dtype == torch.int32 and zp.shape[0] * 8 >= n and zp.shape[0] != n:
            zp = unpack_int32(zp, 0)[:n].to(torch.int32) - 8  # packed along the output
        zeros = zp.to(torch.int32).view(n, groups) + 8
    gs = k // groups
    g_idx = parts.get("weight_g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // gs
    return _groups_to_blocks(u, scales, zeros, g_idx, name, "compressed-tensors")


_CONVERT = {"gptq": convert_gptq, "awq": convert_awq, "compressed-tensors": convert_compressed}


def read_int4(
    tensors: Iterator[tuple[str, torch.Tensor]],
    scheme: dict[str, Any],
    keep_quantized: bool = True,
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """Wrap a checkpoint's (name, tensor) stream: each quantized linear's packed parts
    (``<prefix>.qweight`` ...) become one ``<prefix>.weight`` QuantWeight (or its float32
    dequantization without ``keep_quantized``); other tensors pass through. The packed
    parts are held (int32, as stored) until the stream ends, then converted one linear
    at a time. Raises ValueError naming the linear for an incomplete or malformed one."""
    method = scheme["method"]
    suffixes = _PARTS[method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix in suffixes:
            pending.setdefault(prefix, {})[suffix] = value
        else:
            yield name, value
    required = (
        ("weight_packed", "weight_scale")
        if method == "compressed-tensors"
        else ("qweight", "qzeros", "scales")
    )
    for prefix, parts in pending.items():
        missing = [r for r in required if r not in parts]
        if missing:
            raise ValueError(f"{method} checkpoint: {prefix} lacks {', '.join(missing)}")
        w = _CONVERT[method](parts, scheme, prefix)
        yield f"{prefix}.weight", w if keep_quantized else w.dequantize()


def wrap_checkpoint(
    folder: Path,
    tensors: Iterator[tuple[str, torch.Tensor]],
    keep_quantized: bool = True,
) -> Iterator[tuple[str, Any]]:
    """The loader's hook: ``tensors`` unchanged for an unquantized folder, else
    :func:`read_int4` over them (quantized with ``keep_quantized``, float32 otherwise).
    Raises ValueError for a quantization method this module does not read."""
    scheme = detect(folder)
    if scheme is None:
        return tensors
    return read_int4(tensors, scheme, keep_quantized)
