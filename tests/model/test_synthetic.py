"""Synthetic models (kvserve.model.synthetic), the packed weight cache and the sizing
of KV cache and calibration for large models.

A tiny shape stands in for the real ones (the writers are shape-generic; the real
shapes' figures are checked against their hub configs below, and the 1B shape's
greedy output against transformers in benchmarks, see docs/model-sizes.md).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.model import synthetic as syn

TINY = syn.Shape("tiny", "llama", 256, 2, 4, 2, 512, 49152 + 64, False, 500000.0, 1e-5, 4096,
                 syn._llama3(8.0))  # fmt: skip
TINY_QWEN = replace(TINY, name="tiny-qwen", arch="qwen2", tied=True, rope_scaling=None)


@pytest.fixture(scope="module")
def base() -> syn.BaseTokenizer:
    return syn.load_base_tokenizer()


def _gguf(tmp: Path, shape: syn.Shape, fmt: str, base: syn.BaseTokenizer) -> Path:
    path = tmp / f"{shape.name}-{fmt}.gguf"
    syn.write_gguf(shape, fmt, 0, base, path, lambda _: None)
    return path


def test_real_shapes_match_their_configs() -> None:
    s = syn.SHAPES
    assert set(s) >= {"llama-3.2-1b", "qwen2.5-1.5b", "llama-3.2-3b", "qwen2.5-7b", "llama-3.1-8b"}
    e = s["llama-3.1-8b"]
    assert (e.hidden, e.layers, e.heads, e.kv_heads, e.intermediate, e.vocab, e.tied) == (
        4096, 32, 32, 8, 14336, 128256, False)  # fmt: skip
    assert e.rope_theta == 500000.0 and e.rope_scaling and e.rope_scaling["factor"] == 8.0
    one = s["llama-3.2-1b"]
    assert (one.hidden, one.layers, one.intermediate, one.tied, one.head_dim) == (
        2048,
        16,
        8192,
        True,
        64,
    )
    q = s["qwen2.5-7b"]
    assert (q.hidden, q.layers, q.heads, q.kv_heads, q.intermediate, q.vocab) == (
        3584, 28, 28, 4, 18944, 152064)  # fmt: skip
    assert q.qkv_bias and q.rope_theta == 1e6
    assert 6.5e9 < syn.linear_weights(e) < 7.5e9  # the 8B has ~7B weights in its layers


def test_packed_entry_fuses_parts_as_views(tmp_path: Path, base: syn.BaseTokenizer) -> None:
    from kvserve.model.quant import packed_cache
    from kvserve.model.quant.formats import QuantWeight
    from kvserve.model.quant.gguf import read_tensors

    path = _gguf(tmp_path, TINY, "gguf-q8_0", base)
    entry = tmp_path / "entry"
    stored = list(packed_cache._write(entry, read_tensors(path, TINY.heads, TINY.kv_heads)))
    got = packed_cache._read(entry)
    assert got is not None and [n for n, _ in got] == [n for n, _ in stored]
    by = dict(got)
    a = "model.layers.1.self_attn."
    q, k, v = (by[f"{a}{x}_proj.weight"] for x in "qkv")
    assert isinstance(q, QuantWeight) and isinstance(k, QuantWeight) and isinstance(v, QuantWeight)
    fused = QuantWeight.cat([q, k, v])
    assert fused.data.data_ptr() == q.data.data_ptr()  # a view of the mapping, no copy
    want = QuantWeight.cat([x for n, x in stored if n.startswith(a) and n.endswith("_proj.weight")
                            and "o_proj" not in n])  # fmt: skip
    assert torch.equal(fused.data, want.data)
    for (n1, x1), (_, x2) in zip(stored, got, strict=True):
        t1 = x1.data if isinstance(x1, QuantWeight) else x1
        t2 = x2.data if isinstance(x2, QuantWeight) else x2
        assert torch.equal(t1, t2), n1


@pytest.mark.parametrize("fmt", ["gguf-q4_k_m", "gguf-q8_0", "gguf-q4_0", "gguf-bf16"])
def test_gguf_types_and_values(tmp_path: Path, base: syn.BaseTokenizer, fmt: str) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(_gguf(tmp_path, TINY, fmt, base))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    head = types["output.weight"]
    if fmt == "gguf-q4_k_m":
        assert head == "Q6_K" and types["blk.0.attn_q.weight"] == "Q4_K"
        assert types["blk.1.attn_v.weight"] == "Q6_K"  # use_more_bits: the last eighth
        assert types["blk.0.attn_v.weight"] == "Q4_K"
        assert types["blk.1.ffn_down.weight"] == "Q6_K" and types["blk.1.ffn_gate.weight"] == "Q4_K"
    elif fmt == "gguf-q4_0":
        assert head == "Q6_K" and types["blk.1.ffn_up.weight"] == "Q4_0"
    elif fmt == "gguf-q8_0":
        assert set(
            v
            for k, v in types.items()
            if not k.endswith("norm.weight") and k != "rope_freqs.weight"
        ) == {"Q8_0"}
    else:
        assert types["blk.0.attn_q.weight"] == "BF16"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["rope_freqs.weight"] == "F32"
    assert r.fields["llama.vocab_size"].contents() == TINY.vocab
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == TINY.vocab and tokens[-1] == f"<|x{TINY.vocab - 1}|>"
    for t in r.tensors:
        if t.name in ("blk.0.attn_q.weight", "output.weight", "blk.1.ffn_down.weight"):
            w = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
            assert abs(w.mean()) < 3e-3, (t.name, w.mean())  # Q4_0: -d/2 by its format
            assert 0.015 < w.std() < 0.025, (t.name, w.std())
        if t.name == "blk.0.ffn_norm.weight":
            assert np.all(np.asarray(t.data) == 1.0)


def test_bf16_gguf_and_hf_folder_hold_one_model(tmp_path: Path, base: syn.BaseTokenizer) -> None:
    """The two bf16 formats are the same weights (llama.cpp's q/k order undone)."""
    from safetensors.torch import load_file

    from kvserve.model.quant.gguf import read_tensors

    path = _gguf(tmp_path, TINY, "gguf-bf16", base)
    folder = tmp_path / "hf"
    folder.mkdir()
    syn.write_hf(TINY, 0, base, folder, lambda _: None, shard_bytes=4 << 20)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 1  # sharded, with an index naming every tensor
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    hf: dict[str, torch.Tensor] = {}
    for f in shards:
        hf.update(load_file(f))
    assert set(index["weight_map"]) == set(hf)
    got = dict(read_tensors(path, TINY.heads, TINY.kv_heads))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):  # fmt: skip
        a = got[name]
        assert isinstance(a, torch.Tensor)
        assert torch.equal(a, hf[name].float()), name
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 2 and cfg["rope_scaling"]["rope_type"] == "llama3"
    tok = json.loads((folder / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == TINY.vocab


@pytest.mark.model
def test_hf_folder_greedy_equals_transformers(tmp_path: Path, base: syn.BaseTokenizer) -> None:
    """kvserve on the hf-bf16 folder in float32 = transformers' greedy ids on it."""
    from transformers import AutoModelForCausalLM

    from kvserve import LLM, SamplingParams

    for shape in (TINY, TINY_QWEN):
        folder = tmp_path / shape.name
        folder.mkdir()
        syn.write_hf(shape, 1, base, folder, lambda _: None)
        prompts = [[1, 42, 977, 5000, 49000 + i] for i in range(3)]
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        want = []
        with torch.no_grad():
            for p in prompts:
                out = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)  # fmt: skip
                want.append(out[0, len(p) :].tolist())
        llm = LLM(
            model=str(folder), dtype="float32", num_kv_blocks=64, max_model_len=512, max_step_ms=0
        )
        got = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        )
        assert [list(o.outputs[0].token_ids) for o in got] == want, shape.name
        del llm


def test_generate_is_cached_and_keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(syn.SHAPES, "tiny", TINY)
    out = tmp_path / "m"
    p = syn.generate("tiny", "gguf-q8_0", out=out)
    assert p == out / "model.gguf" and p.is_file()
    mtime = p.stat().st_mtime_ns
    assert syn.generate("tiny", "gguf-q8_0", out=out) == p and p.stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="another synthetic model"):
        syn.generate("tiny", "gguf-q4_0", out=out)
    with pytest.raises(ValueError, match="unknown shape"):
        syn.generate("nope", "gguf-q8_0", out=tmp_path / "x")
    assert syn.cache_key("tiny", "gguf-q8_0", 0) in str(syn.default_out("tiny", "gguf-q8_0", 0))


@pytest.mark.model
def test_packed_cache_maps_the_second_load(
    tmp_path: Path,
    base: syn.BaseTokenizer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The second load of a GGUF maps the first one's panels (fused parts as views of the
    mapping, no repack) and runs the same greedy ids; a damaged entry is rebuilt."""
    import logging

    from kvserve import LLM, SamplingParams
    from kvserve.model.quant import packed_cache

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf(tmp_path, TINY, "gguf-q4_k_m", base)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 2, 3, 400, 5000]}]

    def run() -> tuple[list[int], object]:
        llm = LLM(model=str(path), num_kv_blocks=32, max_model_len=256, max_step_ms=0)
        ids = list(llm.generate(prompt, params)[0].outputs[0].token_ids)
        return ids, llm

    with caplog.at_level(logging.INFO, logger="kvserve.model.quant.packed_cache"):
        cold, llm = run()
        assert "mapped" not in caplog.text
        del llm
        entries = list((tmp_path / "cache" / "packed").iterdir())
        assert len([e for e in entries if (e / "index.json").is_file()]) == 1
        warm, llm = run()
        assert "weights mapped from the packed cache" in caplog.text
    assert warm == cold
    del llm
    entry = next(
        e for e in (tmp_path / "cache" / "packed").iterdir() if (e / "index.json").is_file()
    )
    with open(entry / "weights.bin", "r+b") as f:
        f.truncate(100)  # a damaged entry: offsets run past the end
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvserve.model.quant.packed_cache"):
        again, llm = run()
    assert again == cold and "unreadable" in caplog.text
    del llm
    monkeypatch.setenv("KVSERVE_PACKED_CACHE", "0")
    assert not packed_cache.enabled()


def test_cat_bytes_views_adjacent_parts() -> None:
    from kvserve.model.quant.formats import cat_bytes

    whole = torch.arange(64, dtype=torch.uint8)
    a, b = whole[0:16], whole[16:48]
    v = cat_bytes([a, b])
    assert v.data_ptr() == a.data_ptr() and torch.equal(v, whole[:48])
    c = cat_bytes([a, whole[32:48]])  # not adjacent: a copy
    assert c.data_ptr() != a.data_ptr() and torch.equal(c, torch.cat([a, whole[32:48]]))


def test_auto_kv_cache_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.worker import model_runner as mr

    monkeypatch.setattr(mr, "_mem_available", lambda: 20 << 30)
    per_token = 128 * 1024  # an 8B model in bf16
    got, why = mr.auto_kv_cache_bytes(per_token, 5 << 30)
    assert got == mr.AUTO_KV_TOKENS * per_token  # 4 GiB: 32k tokens fit under the cap
    assert "32768 tokens" in why and "15.0 GiB" in why
    small, _ = mr.auto_kv_cache_bytes(23 * 1024, 100 << 20)  # the default model: 1 GiB floor
    assert small == 1 << 30
    monkeypatch.setattr(mr, "_mem_available", lambda: 6 << 30)
    capped, _ = mr.auto_kv_cache_bytes(per_token, 5 << 30)
    assert capped == (1 << 30) // 2  # half of what is left


def test_calibration_shapes_scale_with_the_model() -> None:
    from kvserve.worker import step_cost as sc

    same, limit = sc.shapes_for_size(sc.DEFAULT_SHAPES, 100e6)
    assert same == sc.DEFAULT_SHAPES and limit == sc.CALIBRATION_MAX_S
    big, big_limit = sc.shapes_for_size(sc.DEFAULT_SHAPES, 7e9)
    chunks = [n for s in big for n, _ in s.prefill]
    assert max(chunks) == 32 and min(chunks) >= sc.MIN_PREFILL_CHUNK  # 512 / 16
    assert sc.CALIBRATION_MAX_S < big_limit <= sc.MAX_CALIBRATION_S
    assert [s.num_decodes for s in big] == [s.num_decodes for s in sc.DEFAULT_SHAPES]


@pytest.mark.model
def test_gguf_rope_freqs_applied_as_llama_cpp(tmp_path: Path, base: syn.BaseTokenizer) -> None:
    """Llama 3's RoPE scaling lives in a GGUF only as ``rope_freqs.weight``: the bf16
    GGUF then runs the same RoPE (and greedy ids) as the HF folder's llama3 config,
    and not plain RoPE."""
    from kvserve import LLM, SamplingParams
    from kvserve.model.arch import ModelArchConfig
    from kvserve.model.loader import _with_gguf_rope_freqs, load_hf_config

    path = _gguf(tmp_path, TINY, "gguf-bf16", base)
    folder = tmp_path / "hf"
    folder.mkdir()
    syn.write_hf(TINY, 0, base, folder, lambda _: None)
    hf_arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
    plain = replace(hf_arch, rope_inv_freq=tuple(
        1.0 / (TINY.rope_theta ** (i / TINY.head_dim)) for i in range(0, TINY.head_dim, 2)))  # fmt: skip
    got = _with_gguf_rope_freqs(plain, path)
    assert np.allclose(got.rope_inv_freq, hf_arch.rope_inv_freq, rtol=1e-6)
    assert not np.allclose(plain.rope_inv_freq, hf_arch.rope_inv_freq, rtol=1e-3)
    prompts = [
        {"prompt_token_ids": [1 + (i * 7919 + j * 104729) % 49000 for j in range(96)]}
        for i in range(3)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    ids, lps = [], []
    for model in (str(path), str(folder)):
        llm = LLM(model=model, dtype="float32", quantization="auto", num_kv_blocks=64,
                  max_model_len=512, max_step_ms=0)  # fmt: skip
        outs = llm.generate(prompts, params)
        ids.append([list(o.outputs[0].token_ids) for o in outs])
        lps.append([[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs])
        del llm
    assert ids[0] == ids[1]
    # the RoPE shows in the log-probabilities (random weights: near-uniform attention)
    assert np.allclose(lps[0], lps[1], rtol=0, atol=2e-5), np.abs(np.subtract(lps[0], lps[1])).max()
