"""GGUF block decoding: kvserve's repacked weights dequantize to what the gguf package
dequantizes, bit for bit (Q4_0/Q4_1/Q8_0 and the K-quants, whose integers and scales
are kept as they are: quant/kquant.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.model.quant.gguf import _from_blocks, _from_kquant, _unpermute_index, hf_name


def _random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid raw rows of a GGUF type: random bytes with sane fp16 scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)

    def scale(offset: int, lo: float, hi: float) -> None:
        vals = rng.uniform(lo, hi, size=(n, k // block)).astype(np.float16)
        raw[:, :, offset : offset + 2] = vals.view(np.uint8).reshape(n, k // block, 2)

    if type_name in ("Q4_0", "Q8_0"):
        scale(0, 0.001, 0.02)
    elif type_name in ("Q4_1", "Q4_K", "Q5_K"):
        scale(0, 0.001, 0.02)
        scale(2, -0.05 if type_name == "Q4_1" else 0.0005, 0.05 if type_name == "Q4_1" else 0.002)
    elif type_name == "Q6_K":
        scale(size - 2, 0.0005, 0.002)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_types_repack_exactly(type_name: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = _random_blocks(type_name, 24, 96)
    ref = dequantize(raw, GGMLQuantizationType[type_name]).reshape(24, 96)
    got = _from_blocks(raw, type_name, 24, 96).dequantize().numpy()
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_repack_exactly(type_name: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = _random_blocks(type_name, 20, 512, seed=1)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).reshape(20, 512))
    w = _from_kquant(raw, type_name, 20, 512)
    assert torch.equal(w.dequantize(), ref)
    assert w.fmt.name == {"Q4_K": "kq4", "Q5_K": "kq5", "Q6_K": "kq6"}[type_name]


def test_names_and_row_order() -> None:
    assert hf_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="no Llama-family"):
        hf_name("blk.0.ffn_gate_exps.weight")
    # transformers' reverse permutation of llama.cpp's q/k rows, on indices
    w = np.arange(16)
    expect = w.reshape(2, 4, 2).swapaxes(2, 1).reshape(16)
    assert _unpermute_index(16, 2).tolist() == expect.tolist()
