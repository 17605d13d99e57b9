"""GGUF K-quants run as they ship (quant/kquant.py, csrc/linear_kquant.cpp).

Synthetic GGUF files are written with the gguf package (random valid super-blocks:
gguf-py has no K-quant quantizer) and read back through kvserve's GGUF reader. Held:
the executed weight is gguf's own dequantization bit for bit; the linear on every path
(AVX512-VNNI, AVX2, scalar) is bitwise one result, within fp32 rounding of the fp64
reference, and within the activation-quantization bound of ``x @ W^T`` in float; a
Q4_K_M-style mix (Q4_K q/k/gate/up, Q6_K v/down) runs fused; resident bytes match the
file's (Q6_K exactly, Q4_K/Q5_K within 3 %); a row's result does not depend on M.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.fused_decode import assert_fused_is_loop, decode_meta, prefilled

from kvserve.model.quant.formats import BLOCK, QuantWeight, quantize_activations
from kvserve.model.quant.kquant import GGUF_BLOCK_BYTES, KQuantWeight, reference_linear_k
from kvserve.model.quant.linear import QuantEmbedding, QuantLinear

K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]


def _raw(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random valid rows [n, k/256 * block bytes] of a K-quant type (sane fp16 scales)."""
    rng = np.random.default_rng(seed)
    nsb = k // 256
    raw = rng.integers(0, 256, size=(n, nsb, GGUF_BLOCK_BYTES[type_name]), dtype=np.uint8)
    offsets = [208] if type_name == "Q6_K" else [0, 2]
    for off, (lo, hi) in zip(offsets, [(2e-4, 2e-3), (2e-4, 1e-3)], strict=False):
        vals = rng.uniform(lo, hi, size=(n, nsb)).astype(np.float16)
        raw[:, :, off : off + 2] = vals.view(np.uint8).reshape(n, nsb, 2)
    return raw.reshape(n, -1)


def _gguf_dequant(raw: np.ndarray, type_name: str, n: int, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    arr = dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)
    return torch.from_numpy(arr).reshape(n, k)


def _spec_dequant(spec: dict, name: str) -> torch.Tensor:
    type_name, raw, (n, k) = spec[name]
    return _gguf_dequant(raw, type_name, n, k)


def _write_gguf(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(str(path), "qwen2")  # not "llama": no q/k row permutation
    for name, (type_name, raw) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _read(path: Path) -> dict[str, torch.Tensor | QuantWeight]:
    from kvserve.model.quant.gguf import read_tensors

    return dict(read_tensors(path, num_heads=4, num_kv_heads=2))


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|kernel - x @ W^T| <= sum_b d_x,b / 2 * sum_{j in b} |w_j| (the int8 rounding of
    the activations, at most half a step each) + fp32 rounding of the sums."""
    _, dx, _ = quantize_activations(x)
    absw = w.abs().double().view(w.shape[0], -1, BLOCK).sum(-1)  # [n, nb]
    quant = 0.5 * dx.double() @ absw.T
    return quant + 1e-5 * (x.abs().double() @ w.abs().double().T) + 1e-6


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A Q4_K_M-style layer: Q4_K q/k/gate/up, Q6_K v/down, a Q5_K o (k = 512)."""
    shapes = {
        "blk.0.attn_q.weight": ("Q4_K", 64, 512),
        "blk.0.attn_k.weight": ("Q4_K", 32, 512),
        "blk.0.attn_v.weight": ("Q6_K", 32, 512),
        "blk.0.attn_output.weight": ("Q5_K", 512, 512),
        "blk.0.ffn_gate.weight": ("Q4_K", 256, 512),
        "blk.0.ffn_up.weight": ("Q4_K", 256, 512),
        "blk.0.ffn_down.weight": ("Q6_K", 512, 256),
        "token_embd.weight": ("Q6_K", 40, 512),  # n not a multiple of 16: padded panel
    }
    tensors = {
        name: (t, _raw(t, n, k, seed=i)) for i, (name, (t, n, k)) in enumerate(shapes.items())
    }
    path = tmp_path_factory.mktemp("kq") / "mix.gguf"
    _write_gguf(path, tensors)
    return path, {name: (t, raw, shapes[name][1:]) for name, (t, raw) in tensors.items()}


def test_read_back_is_gguf_dequantization_exactly(gguf_file: tuple[Path, dict]) -> None:
    path, spec = gguf_file
    got = _read(path)
    from kvserve.model.quant.gguf import hf_name

    for name, (type_name, raw, (n, k)) in spec.items():
        w = got[hf_name(name) or ""]
        assert isinstance(w, KQuantWeight), name
        assert w.fmt.name == {"Q4_K": "kq4", "Q5_K": "kq5", "Q6_K": "kq6"}[type_name]
        assert torch.equal(w.dequantize(), _gguf_dequant(raw, type_name, n, k)), name


@pytest.mark.parametrize("type_name", K_TYPES)
def test_resident_bytes_vs_file(type_name: str) -> None:
    from kvserve.model.quant.kquant import from_gguf

    raw = _raw(type_name, 64, 1024, seed=3)
    w = from_gguf(raw, type_name, 64, 1024)
    ratio = w.nbytes / raw.nbytes
    if type_name == "Q6_K":
        assert w.nbytes == raw.nbytes  # 6.5625 bits per weight, as the file
    else:
        assert 1.0 < ratio < 1.03, ratio  # 8-bit sub-block scales instead of 6-bit


@pytest.mark.parametrize("type_name", K_TYPES)
def test_linear_paths_match_reference_and_float(kernel, type_name: str) -> None:  # type: ignore[no-untyped-def]
    from kvserve.model.quant.kquant import from_gguf

    n, k = 48, 768
    raw = _raw(type_name, n, k, seed=7)
    w = from_gguf(raw, type_name, n, k)
    wf = _gguf_dequant(raw, type_name, n, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    ref = reference_linear_k(x, w, bias)
    outs = {
        p: kernel.linear(x, w, bias, path=p)
        for p in ("scalar", "avx2", "vnni")
        if p in kernel.paths
    }
    first = next(iter(outs.values()))
    for p, y in outs.items():
        assert torch.equal(y, first), p  # one arithmetic on every path
    scale = ref.abs().max().item()
    assert (first - ref).abs().max().item() <= 2e-6 * scale * k**0.5
    exact = x.double() @ wf.double().T + bias.double()
    err = (first.double() - exact).abs()
    assert bool((err <= _bound(x, wf)).all()), (err - _bound(x, wf)).max()
    # the bound is tight enough to catch a wrong weight: one flipped sub-block fails it
    wrong = wf.clone()
    wrong[3, :32] += 0.5 * wrong[3, :32].abs().max()
    err_wrong = (first.double() - (x.double() @ wrong.double().T + bias.double())).abs()
    assert not bool((err_wrong <= _bound(x, wrong)).all())


@pytest.mark.parametrize("type_name", K_TYPES)
def test_bf16_and_row_invariance(kernel, type_name: str) -> None:  # type: ignore[no-untyped-def]
    from kvserve.model.quant.kquant import from_gguf

    n, k = 40, 512
    w = from_gguf(_raw(type_name, n, k, seed=11), type_name, n, k)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    full = kernel.linear(x, w)
    assert full.dtype == torch.bfloat16 and full.shape == (70, n)
    for rows in (slice(5, 6), slice(0, 8), slice(3, 35)):
        assert torch.equal(kernel.linear(x[rows], w), full[rows])
    ref = reference_linear_k(x.float(), w)
    assert torch.allclose(full.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_q4_k_m_mix_fused_layers(kernel, gguf_file: tuple[Path, dict]) -> None:  # type: ignore[no-untyped-def]
    """q/k (Q4_K) + v (Q6_K) as one fused qkv of two parts; gate+up (Q4_K) as one part;
    each equals the float matmul of gguf's dequantization within the bound."""
    path, spec = gguf_file
    got = _read(path)
    pre = "model.layers.0."
    q, kk, v = (got[pre + f"self_attn.{p}_proj.weight"] for p in "qkv")
    assert isinstance(q, QuantWeight) and isinstance(kk, QuantWeight) and isinstance(v, QuantWeight)
    qk = QuantWeight.cat([q, kk])
    assert isinstance(qk, KQuantWeight) and qk.n == 96
    lin = QuantLinear([qk, v], None, kernel)
    wf = torch.cat([_spec_dequant(spec, f"blk.0.attn_{p}.weight") for p in "qkv"])
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5))
    y = lin(x)
    assert y.shape == (3, 128)
    err = (y.double() - x.double() @ wf.double().T).abs()
    assert bool((err <= _bound(x, wf)).all())
    assert not lin.fused_silu_capable  # K-quant gate_up runs linear then SiLU
    gu = QuantLinear(
        [QuantWeight.cat([got[pre + "mlp.gate_proj.weight"], got[pre + "mlp.up_proj.weight"]])],
        None,
        kernel,
    )  # type: ignore[list-item]
    g, u = gu(x).chunk(2, -1)
    assert torch.equal(gu.silu_mul(x), torch.nn.functional.silu(g) * u)
    # no kernel: the PyTorch reference runs the same weights
    ref_lin = QuantLinear([qk, v], None, None)
    assert torch.allclose(ref_lin(x), y, atol=1e-4 * y.abs().max().item())


def test_embedding_rows_exact(kernel, gguf_file: tuple[Path, dict]) -> None:  # type: ignore[no-untyped-def]
    path, spec = gguf_file
    table = _read(path)["model.embed_tokens.weight"]
    assert isinstance(table, KQuantWeight)
    ids = torch.tensor([0, 17, 39, 17])
    full = _spec_dequant(spec, "token_embd.weight")
    assert torch.equal(QuantEmbedding([table], torch.float32, kernel)(ids), full[ids])
    assert torch.equal(QuantEmbedding([table], torch.float32, None)(ids), full[ids])
    bf = QuantEmbedding([table], torch.bfloat16, kernel)(ids)
    assert torch.equal(bf, full[ids].to(torch.bfloat16))


def test_llama_row_order_undone(tmp_path: Path) -> None:
    """In llama-architecture files q/k rows are permuted for llama.cpp's RoPE; the
    reader undoes it on K-quant panels as on float tensors."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from kvserve.model.quant.gguf import _unpermute_index, read_tensors

    raw = _raw("Q4_K", 64, 256, seed=13)
    path = tmp_path / "l.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = dict(read_tensors(path, num_heads=4, num_kv_heads=2))[
        "model.layers.0.self_attn.q_proj.weight"
    ]
    assert isinstance(got, KQuantWeight)
    want = _gguf_dequant(raw, "Q4_K", 64, 256)[_unpermute_index(64, 4)]
    assert torch.equal(got.dequantize(), want)


def test_bad_k_is_a_clear_error() -> None:
    from kvserve.model.quant.kquant import from_gguf

    with pytest.raises(ValueError, match="multiple of 256"):
        from_gguf(np.zeros((2, 144), np.uint8), "Q4_K", 2, 128)


def _q4_k_m_model() -> tuple[object, dict[str, torch.Tensor | QuantWeight], int]:
    """A 2-layer Llama's config and weights as a Q4_K_M-style mix (Q4_K q/k/gate/up and
    embedding, Q5_K o, Q6_K v/down/lm_head), and the file bytes of its quantized rows."""
    from transformers import LlamaConfig

    from kvserve.model.llama import ModelArchConfig
    from kvserve.model.quant.kquant import from_gguf

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    kinds = {
        "self_attn.q_proj": ("Q4_K", 256, 256),
        "self_attn.k_proj": ("Q4_K", 128, 256),
        "self_attn.v_proj": ("Q6_K", 128, 256),
        "self_attn.o_proj": ("Q5_K", 256, 256),
        "mlp.gate_proj": ("Q4_K", 512, 256),
        "mlp.up_proj": ("Q4_K", 512, 256),
        "mlp.down_proj": ("Q6_K", 256, 512),
    }
    quant: dict[str, torch.Tensor | QuantWeight] = {}
    seed, file_bytes = 100, 0
    for li in range(2):
        for name, (t, n, k) in kinds.items():
            seed += 1
            raw = _raw(t, n, k, seed)
            file_bytes += raw.nbytes
            quant[f"model.layers.{li}.{name}.weight"] = from_gguf(raw, t, n, k)
        quant[f"model.layers.{li}.input_layernorm.weight"] = torch.ones(256)
        quant[f"model.layers.{li}.post_attention_layernorm.weight"] = torch.ones(256)
    quant["model.embed_tokens.weight"] = from_gguf(_raw("Q4_K", 64, 256, 1), "Q4_K", 64, 256)
    quant["lm_head.weight"] = from_gguf(_raw("Q6_K", 64, 256, 2), "Q6_K", 64, 256)
    quant["model.norm.weight"] = torch.ones(256)
    file_bytes += 64 * 144 + 64 * 210  # the embedding (Q4_K) and lm_head (Q6_K) rows
    return ModelArchConfig.from_hf_config(cfg), quant, file_bytes


def _build(arch, tensors: dict, dtype: torch.dtype):  # type: ignore[no-untyped-def,type-arg]
    from kvserve.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        net = LlamaForCausalLM(arch)
    net = net.to_empty(device=torch.device("cpu"))
    net.load_weights(iter(tensors.items()), dtype=dtype, device=torch.device("cpu"))
    return net.eval().requires_grad_(False)


def test_whole_model_q4_k_m_mix_matches_float(kernel) -> None:  # type: ignore[no-untyped-def]
    """A 2-layer Llama whose weights are a Q4_K_M-style mix (Q4_K q/k/gate/up and
    embedding, Q5_K o, Q6_K v/down/lm_head) runs through the model's native path; its
    logits match the same weights dequantized to float32 up to the int8 rounding of the
    activations, and the weights stay quantized (formats reported)."""
    from kvserve.model.attention import SeqSpec, build_attention_metadata
    from kvserve.worker.model_runner import allocate_kv_cache

    arch, quant, file_bytes = _q4_k_m_model()
    dense = {k: v.dequantize() if isinstance(v, QuantWeight) else v for k, v in quant.items()}
    qnet, fnet = _build(arch, quant, torch.float32), _build(arch, dense, torch.float32)
    assert qnet.weight_formats() == "kq4+kq5+kq6"
    resident = sum(p.nbytes for parts in qnet._quant.values() for p in parts)
    assert file_bytes < resident < 1.03 * file_bytes, (resident, file_bytes)  # 1.017 for this mix
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(9))

    def logits(net) -> torch.Tensor:  # type: ignore[no-untyped-def]
        kv = allocate_kv_cache(net, 5, 16, torch.float32)
        meta = build_attention_metadata(
            [SeqSpec(0, 40, 40, 0, [1, 2, 3])],
            num_tokens=40,
            block_size=16,
            kv_segment_size=64,
            backend="native",
            kv_dtype=torch.float32,
        )
        with torch.inference_mode():
            return net.compute_logits(net(ids, torch.arange(40), list(kv.unbind(0)), meta))

    lq, lf = logits(qnet), logits(fnet)
    assert lq.shape == (40, 64)
    err = (lq - lf).abs().max().item()
    spread = (lf.amax(-1) - lf.amin(-1)).mean().item()
    mean = (lq - lf).abs().mean().item()
    # random, uncentred weights amplify the activation rounding layer by layer (measured:
    # max 8.5 % of the logit spread, 97.5 % agreement); a wrong layout gives ~1/64
    assert err < 0.15 * spread and mean < 0.03 * spread, (err, mean, spread)
    agree = (lq.argmax(-1) == lf.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_k_m_mix_decodes_in_the_fused_step(kernel, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """The fused decode step (kvs_decode_layers) runs the K-quant mix as the Python loop
    does: qkv as two parts into their columns (Q4_K q/k, Q6_K v), K-quant o and down,
    the Q4_K gate_up's linear then SiLU; bitwise the loop's hidden states and KV."""
    arch, quant, _ = _q4_k_m_model()
    net = _build(arch, quant, dtype)
    assert net._fused_decode is not None, "the K-quant mix takes the fused step"
    assert len(net._ops[0].qkv.parts) == 2 and not net._ops[0].gate_up.fused_silu_capable
    lens = [23, 40, 9]
    kv, caches, tables = prefilled(net, dtype, lens, vocab=(0, 64), seed=3)
    ids, pos = torch.tensor([5, 17, 33]), torch.tensor(lens)
    assert_fused_is_loop(net, kv, caches, ids, pos, decode_meta(lens, tables, dtype))


@pytest.mark.parametrize("type_name", K_TYPES)
def test_native_repack_is_the_numpy_one(kernel, type_name: str) -> None:  # type: ignore[no-untyped-def]
    """The C repack (kvs_kquant_pack_gguf, used at load) writes the same bytes as the
    NumPy one, padding panel included."""
    from kvserve.model.quant.kquant import from_gguf

    raw = _raw(type_name, 40, 512, seed=21)
    fast = from_gguf(raw, type_name, 40, 512, kernel)
    slow = from_gguf(raw, type_name, 40, 512)
    assert torch.equal(fast.data, slow.data)
    assert torch.equal(fast.dequantize(), _gguf_dequant(raw, type_name, 40, 512))
