"""The default Q4_1 GGUF run quantized (``quantization="auto"``) against the same
weights dequantized to float32 (``"none"``): weights bitwise equal after dequantizing,
next-token agreement and logit error on real text, resident weight bytes near the
file's size, and a decode row's logits independent of the other rows of its step."""

from __future__ import annotations

import pytest
import torch
from support.prefill import chunked_prefill_logits

from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.worker.model_runner import allocate_kv_cache

pytestmark = pytest.mark.usefixtures("single_thread_torch")

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
)


@pytest.fixture(scope="module")
def quant_model():  # type: ignore[no-untyped-def]
    from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model

    return load_model(DEFAULT_MODEL_NAME, dtype="float32", quantization="auto")


def _prefill_logits(model, ids: list[int], backend: str = "native") -> torch.Tensor:  # type: ignore[no-untyped-def]
    return chunked_prefill_logits(model, ids, chunk=96, backend=backend)


def test_quantized_weights_are_the_files(quant_model, loaded_model) -> None:  # type: ignore[no-untyped-def]
    q, f = quant_model.model, loaded_model.model
    assert quant_model.quantization == "q4_1+q8_0"
    assert q.lm_head is None and "embed_tokens" in q._quant, "tied Q8_0 embedding = lm_head"
    emb = q._quant["embed_tokens"][0]
    assert emb.fmt.name == "q8_0" and torch.equal(emb.dequantize(), f.embed_tokens.data)
    for i in (0, len(q.layers) - 1):
        for name, attr in (("qkv_proj", "qkv"), ("gate_up_proj", "gate_up"), ("down_proj", "down")):
            parts = q._quant[f"layers.{i}.{name}"]
            assert [p.fmt.name for p in parts] == ["q4_1"]
            ref = getattr(f._ops[i], attr).weight.float()
            assert torch.equal(parts[0].dequantize(), ref), (i, name)
    assert quant_model.fingerprint != loaded_model.fingerprint  # KV differs: no sharing


def test_decode_runs_fused_quantized_mlp(quant_model) -> None:  # type: ignore[no-untyped-def]
    """Every layer's gate_up of the shipped file runs the fused linear+SiLU call (one
    native pass per layer), and every projection and the lm_head one bound call."""
    ops = quant_model.model._ops
    assert all(o.gate_up.fused_silu_capable for o in ops)
    lins = [lin for o in ops for lin in (o.qkv, o.o, o.gate_up, o.down)]
    assert all(lin._fast is not None for lin in [*lins, quant_model.model._lm_head])


def test_resident_weights_near_file_size(quant_model) -> None:  # type: ignore[no-untyped-def]
    from kvserve.model.loader import DEFAULT_MODEL_NAME, gguf_source

    file_bytes = gguf_source(DEFAULT_MODEL_NAME).stat().st_size  # type: ignore[union-attr]
    weights = quant_model.model.weight_bytes()
    assert weights <= 1.3 * file_bytes, (weights, file_bytes)


def test_q4_1_tracks_dequantized_float32(quant_model, loaded_model) -> None:  # type: ignore[no-untyped-def]
    ids = loaded_model.tokenizer(TEXT * 6)["input_ids"][:256]
    ref = _prefill_logits(loaded_model.model, ids)
    got = _prefill_logits(quant_model.model, ids)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    err = (got - ref).abs()
    # int8 activation blocks are the only difference (the weights are the same)
    assert agree >= 0.95, f"Q4_1 next-token agreement with dequantized fp32 only {agree:.1%}"
    assert err.max().item() < 2.0 and err.mean().item() < 0.2, (err.max(), err.mean())
    # portable attention (a different fp32 rounding order feeding the int8 activation
    # rounding) tracks the float reference as closely
    portable = _prefill_logits(quant_model.model, ids[:64], backend="portable")
    agree_p = (portable.argmax(-1) == ref[:64].argmax(-1)).float().mean().item()
    assert agree_p >= 0.95 and (portable - ref[:64]).abs().max().item() < 2.0


def test_decode_row_independent_of_batch(quant_model, loaded_model) -> None:  # type: ignore[no-untyped-def]
    """A request's logits are bitwise the same decoded alone or with 7 others."""
    model = quant_model.model
    ids = loaded_model.tokenizer(TEXT)["input_ids"][:40]
    bs = 16
    n_seqs = 8
    kv = allocate_kv_cache(model, 1 + n_seqs * 4, bs, torch.float32)
    caches = list(kv.unbind(0))
    tables = [list(range(1 + 4 * s, 5 + 4 * s)) for s in range(n_seqs)]
    with torch.inference_mode():
        for s in range(n_seqs):  # prefill each sequence (different lengths)
            n = 20 + s
            meta = build_attention_metadata(
                [SeqSpec(0, n, n, 0, tables[s])],
                num_tokens=n,
                block_size=bs,
                kv_segment_size=64,
                kv_dtype=torch.float32,
            )
            model(torch.tensor(ids[:n]), torch.arange(n), caches, meta)

        def decode(seqs: list[int]) -> torch.Tensor:
            specs = [SeqSpec(j, 1, 1, 20 + s, tables[s]) for j, s in enumerate(seqs)]
            meta = build_attention_metadata(
                specs,
                num_tokens=len(seqs),
                block_size=bs,
                kv_segment_size=64,
                kv_dtype=torch.float32,
            )
            tok = torch.tensor([ids[20 + s] for s in seqs])
            pos = torch.tensor([20 + s for s in seqs])
            return model.compute_logits(model(tok, pos, caches, meta))

        alone = decode([3])
        batched = decode(list(range(n_seqs)))
    assert torch.equal(alone[0], batched[3])


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_at_load_tracks_float(mode: str, tmp_path, default_model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A float HF folder quantized at load (bias and untied lm_head included)."""
    from test_model_vs_hf import make_tiny_model  # type: ignore[import-not-found]

    from kvserve.model.loader import load_model

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    make_tiny_model("llama-bias-tied", folder, default_model_dir)
    ref = load_model(str(folder), dtype="float32", quantization="auto")
    assert ref.quantization == "float", "auto keeps a float checkpoint in float"
    q = load_model(str(folder), dtype="float32", quantization=mode)
    assert q.quantization == ("q8_0" if mode == "int8" else "q4_1+q8_0")
    assert q.fingerprint != ref.fingerprint
    ids = list(range(5, 69))
    got, want = _prefill_logits(q.model, ids), _prefill_logits(ref.model, ids)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < (0.05 if mode == "int8" else 0.3), rel
    with pytest.raises(ValueError, match="invalid quantization"):
        load_model(str(folder), dtype="float32", quantization="int3")
