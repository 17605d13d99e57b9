"""GPTQ / AWQ / compressed-tensors int4 folders (quant/hf_int4.py).

The test quantizes a known float weight itself and packs it with each format's
documented layout (written here independently of the reader), then checks that the
loaded panels dequantize to the reference dequantization (exactly for symmetric
weights, within fp16 rounding of the zero term otherwise), that the executed linear is
within the activation-quantization bound of ``x @ W_ref^T`` (act-order included), and
that ``load_model`` on a tiny Llama folder detects the scheme from config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.fused_decode import assert_fused_is_loop, decode_meta, prefilled
from support.tiny_models import save_tiny_hf_llama

from kvserve.model.kernels.backend import default_backend
from kvserve.model.quant.formats import BLOCK, QuantWeight, quantize_activations
from kvserve.model.quant.hf_int4 import AWQ_ORDER, read_int4
from kvserve.model.quant.linear import QuantLinear


def _quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool):  # type: ignore[no-untyped-def]
    """w [out, in] -> q [out, in] (0..15), scale [out, G] fp16, zero [out, G] int, and
    the reference dequantization scale * (q - zero) (fp32)."""
    out = w.shape[0]
    scale = torch.empty(out, groups, dtype=torch.float16)
    zero = torch.empty(out, groups, dtype=torch.int32)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scale[:, g] = (cols.abs().amax(1) / 7).to(torch.float16)
            zero[:, g] = 8
        else:
            lo, hi = cols.amin(1), cols.amax(1)
            scale[:, g] = ((hi - lo) / 15).to(torch.float16)
            zero[:, g] = torch.round(-lo / scale[:, g].float()).clamp(1, 15).to(torch.int32)
    s, z = scale[:, g_idx].float(), zero[:, g_idx]
    q = (torch.round(w / s) + z).clamp(0, 15).to(torch.int32)
    return q, scale, zero, s * (q - z).float()


def _pack_rows(v: torch.Tensor) -> torch.Tensor:
    """v [8 * R, C] (0..15) -> int32 [R, C]: row 8r+t at bits 4t of row r."""
    v = v.to(torch.int64).view(-1, 8, v.shape[1])
    word = sum(v[:, t] << (4 * t) for t in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _pack_cols(v: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """v [R, 8 * C] -> int32 [R, C]: column 8c + order[s] at bits 4s of word c."""
    v = v.to(torch.int64).view(v.shape[0], -1, 8)
    word = sum(v[:, :, order[s]] << (4 * s) for s in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _gptq(w: torch.Tensor, gs: int, sym: bool, act_order: bool, seed: int = 0, v2: bool = False):  # type: ignore[no-untyped-def]
    out, k = w.shape
    g_idx = torch.arange(k) // gs
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // gs
    q, scale, zero, ref = _quantize(w, g_idx, k // gs, sym)
    parts = {
        "qweight": _pack_rows(q.T),  # [in/8, out]
        "qzeros": _pack_cols(zero.T - (0 if v2 else 1)),  # [G, out/8], v1: zero - 1
        "scales": scale.T.contiguous(),  # [G, out]
        "g_idx": g_idx.to(torch.int32),
    }
    return parts, ref


def _awq(w: torch.Tensor, gs: int):  # type: ignore[no-untyped-def]
    out, k = w.shape
    q, scale, zero, ref = _quantize(w, torch.arange(k) // gs, k // gs, sym=False)
    parts = {
        "qweight": _pack_cols(q.T, AWQ_ORDER),  # [in, out/8]
        "qzeros": _pack_cols(zero.T, AWQ_ORDER),  # [G, out/8]
        "scales": scale.T.contiguous(),
    }
    return parts, ref


def _compressed(w: torch.Tensor, gs: int, sym: bool):  # type: ignore[no-untyped-def]
    out, k = w.shape
    g_idx = torch.arange(k) // gs
    q, scale, zero, _ = _quantize(w, g_idx, k // gs, sym)
    scale = scale.to(torch.bfloat16)  # bf16 in llm-compressor files
    ref = scale[:, g_idx].float() * (q - zero[:, g_idx]).float()
    # stored value = signed q + 8 = (q - 8) + 8; zero point signed = zero - 8
    parts = {
        "weight_packed": _pack_rows(q.T).T.contiguous(),  # [out, in/8], input 8c+t at 4t
        "weight_scale": scale,
        "weight_shape": torch.tensor([out, k]),
    }
    if not sym:
        parts["weight_zero_point"] = (zero - 8).to(torch.int8)
    return parts, ref


def _read(prefix: str, parts: dict, scheme: dict) -> QuantWeight:  # type: ignore[type-arg]
    stream = [(f"{prefix}.{k}", v) for k, v in parts.items()] + [("other.bias", torch.ones(3))]
    got = dict(read_int4(iter(stream), scheme))
    assert torch.equal(got["other.bias"], torch.ones(3))  # non-quantized tensors pass through
    w = got[f"{prefix}.weight"]
    assert isinstance(w, QuantWeight)
    return w


def _check_linear(w: QuantWeight, ref: torch.Tensor) -> None:
    """The executed linear (native where built, else the reference) is within the
    int8-activation bound of x @ ref^T (plus the weight's own fp16 zero rounding)."""
    x = torch.randn(4, ref.shape[1], generator=torch.Generator().manual_seed(3))
    y = QuantLinear([w], None, default_backend().quant_linear)(x).double()
    exact = x.double() @ ref.double().T
    xs = x if w.in_perm is None else x[:, w.in_perm]
    _, dx, _ = quantize_activations(xs)
    refs = ref if w.in_perm is None else ref[:, w.in_perm]
    absw = refs.abs().double().view(ref.shape[0], -1, BLOCK).sum(-1)
    werr = (w.dequantize().double() - ref.double()).abs()
    bound = 0.5 * dx.double() @ absw.T + x.abs().double() @ werr.T
    bound = bound + 1e-5 * (x.abs().double() @ ref.abs().double().T) + 1e-6
    assert bool(((y - exact).abs() <= bound).all())


W = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)) * 0.05


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_symmetric_is_exact(act_order: bool) -> None:
    parts, ref = _gptq(W, 64, sym=True, act_order=act_order)
    scheme = {"method": "gptq", "bits": 4, "group_size": 64, "sym": True, "format": "gptq"}
    w = _read("model.layers.0.mlp.down_proj", parts, scheme)
    assert w.fmt.name == "q4_0"
    assert (w.in_perm is not None) == act_order
    assert torch.equal(w.dequantize(), ref)
    _check_linear(w, ref)


def test_gptq_asymmetric_v2_and_act_order() -> None:
    parts, ref = _gptq(W, 32, sym=False, act_order=True, seed=4, v2=True)
    scheme = {"method": "gptq", "bits": 4, "group_size": 32, "sym": False, "format": "gptq_v2"}
    w = _read("p", parts, scheme)
    assert w.fmt.name == "q4_1" and w.in_perm is not None
    got = w.dequantize()
    assert (got - ref).abs().max().item() <= 15 * ref.abs().max().item() * 2**-10
    _check_linear(w, ref)


def test_awq() -> None:
    parts, ref = _awq(W, 64)
    scheme = {"method": "awq", "bits": 4, "group_size": 64, "sym": False, "format": "gemm"}
    w = _read("model.layers.0.self_attn.o_proj", parts, scheme)
    assert w.fmt.name == "q4_1" and w.in_perm is None
    # the AWQ nibble order matters: reading it as plain order gives another weight
    assert (w.dequantize() - ref).abs().max().item() <= 15 * ref.abs().max().item() * 2**-10
    plain = _read(
        "x",
        {**parts, "qweight": _pack_cols(_quantize(W, torch.arange(256) // 64, 4, False)[0].T)},
        scheme,
    )
    assert not torch.allclose(plain.dequantize(), ref, atol=1e-3)
    _check_linear(w, ref)


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_pack_quantized(sym: bool) -> None:
    parts, ref = _compressed(W, 32, sym)
    scheme = {
        "method": "compressed-tensors",
        "bits": 4,
        "group_size": 32,
        "sym": sym,
        "format": "pack-quantized",
    }
    w = _read("model.layers.0.mlp.up_proj", parts, scheme)
    assert w.fmt.name == ("q4_0" if sym else "q4_1")
    if sym:
        assert torch.equal(w.dequantize(), ref)
    else:
        assert (w.dequantize() - ref).abs().max().item() <= 15 * ref.abs().max().item() * 2**-10
    _check_linear(w, ref)


def test_incomplete_linear_is_a_clear_error() -> None:
    parts, _ = _gptq(W, 64, sym=True, act_order=False)
    del parts["scales"]
    scheme = {"method": "gptq", "bits": 4, "group_size": 64, "sym": True, "format": "gptq"}
    with pytest.raises(ValueError, match="p lacks scales"):
        _read("p", parts, scheme)


def test_fused_parts_need_one_act_order() -> None:
    a, _ = _gptq(W, 64, sym=True, act_order=True, seed=1)
    b, _ = _gptq(W, 64, sym=True, act_order=True, seed=2)
    scheme = {"method": "gptq", "bits": 4, "group_size": 64, "sym": True, "format": "gptq"}
    with pytest.raises(ValueError, match="different act-order"):
        QuantWeight.cat([_read("a", a, scheme), _read("b", b, scheme)])


# --------------------------------------------------------------------------- load_model


def _tiny_gptq_folder(folder: Path, tokenizer_dir: Path, method: str) -> dict[str, torch.Tensor]:
    """A 1-layer Llama (hidden 64) whose linears are stored int4 in ``method``'s layout;
    returns the reference dequantized weights by HF name."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    save_tiny_hf_llama(folder, tokenizer_dir, hidden_size=64, intermediate_size=128)
    tensors = load_file(str(folder / "model.safetensors"))
    refs: dict[str, torch.Tensor] = {}
    for name in list(tensors):
        if not name.endswith("_proj.weight"):
            continue
        w = tensors.pop(name)
        prefix = name.removesuffix(".weight")
        if method == "gptq":
            parts, ref = _gptq(w, 32, sym=True, act_order=True, seed=w.shape[1])
        elif method == "awq":
            parts, ref = _awq(w, 32)
        else:
            parts, ref = _compressed(w, 32, sym=True)
        tensors.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
        refs[name] = ref
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "gptq": {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 32,
            "desc_act": True,
            "sym": True,
        },
        "awq": {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 32,
            "zero_point": True,
            "version": "gemm",
        },
        "compressed-tensors": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": 32,
                    },
                }
            },
            "ignore": ["lm_head"],
        },
    }[method]
    (folder / "config.json").write_text(json.dumps(config))
    return refs


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_load_model_detects_and_runs(tmp_path: Path, default_model_dir: Path, method: str) -> None:
    from kvserve.model.loader import load_model

    refs = _tiny_gptq_folder(tmp_path, default_model_dir, method)
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.quantization == ("q4_1" if method == "awq" else "q4_0")
    net = loaded.model
    pre = "model.layers.0."
    qkv = torch.cat([refs[pre + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    got = torch.cat([p.dequantize() for p in net._quant["layers.0.qkv_proj"]])
    tol = 0.0 if method != "awq" else 15 * qkv.abs().max().item() * 2**-10
    assert (got - qkv).abs().max().item() <= tol
    net.prepare()
    x = torch.randn(3, 64)
    y = net._ops[0].qkv(x)
    assert torch.allclose(y, x @ qkv.T, atol=0.05 * (x @ qkv.T).abs().max().item())
    down = refs[pre + "mlp.down_proj.weight"]
    z = torch.randn(2, 128)
    assert torch.allclose(
        net._ops[0].down(z), z @ down.T, atol=0.05 * (z @ down.T).abs().max().item()
    )
    # quantization='none' reads the same folder dequantized to float
    plain = load_model(str(tmp_path), dtype="float32", quantization="none")
    assert plain.quantization == "float"


def test_unsupported_method_is_a_clear_error(tmp_path: Path, default_model_dir: Path) -> None:
    from kvserve.model.loader import load_model

    _tiny_gptq_folder(tmp_path, default_model_dir, "gptq")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match="bitsandbytes.*not supported.*gptq, awq, compressed-tensors"
    ):
        load_model(str(tmp_path))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_act_order_decodes_in_the_fused_step(
    tmp_path: Path, default_model_dir: Path, dtype: str
) -> None:
    """An act-order GPTQ model decodes in the fused step (kvs_decode_layers gathers each
    linear's inputs into their stored column order, as ``index_select`` does; gate_up's
    fused SiLU on the gathered inputs): bitwise the Python loop's hidden states and KV."""
    from kvserve.model.loader import load_model

    _tiny_gptq_folder(tmp_path, default_model_dir, "gptq")
    loaded = load_model(str(tmp_path), dtype=dtype)
    net, dt = loaded.model, loaded.dtype
    assert net._fused_decode is not None, "act-order weights take the fused step"
    ops = net._ops[0]
    assert ops.qkv.parts[0].in_perm is not None and ops.gate_up.fused_silu_capable
    lens = [21, 35, 8]
    kv, caches, tables = prefilled(net, dt, lens, vocab=(0, 128), blocks_per_seq=3, seed=5)
    ids, pos = torch.tensor([3, 64, 127]), torch.tensor(lens)
    assert_fused_is_loop(net, kv, caches, ids, pos, decode_meta(lens, tables, dt))
