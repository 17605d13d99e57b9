"""8-bit KV cache fidelity: int8 / fp8_e4m3 KV against bfloat16 KV on the same model.

Teacher-forced: the same token sequence runs through the model with each KV format,
prefilled in 96-token chunks (so later chunks read earlier chunks' KV from the cache)
and then decoded one token per step; each position's logits predict the next token.
Figures (SmolLM2-135M Q4_1, bfloat16 activations, 2026-12-01) are in
docs/quantization.md.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.model.kernels.kv8 import resolve_kv_cache_dtype
from kvserve.worker.model_runner import allocate_kv_cache

pytestmark = pytest.mark.usefixtures("single_thread_torch")

TEXTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(10)])\n",
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs red "
    "and blue light, water is split, and carbon dioxide is fixed into sugars. ",
)


@pytest.fixture(scope="module", params=["auto", "none"], ids=["q4_1", "float_weights"])
def bf16_model(request):
    """bfloat16 activations on the shipped Q4_1 weights run quantized (``auto``) and
    on the same weights dequantized (``none``)."""
    from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model

    return load_model(DEFAULT_MODEL_NAME, dtype="bfloat16", quantization=request.param)


def _logits(loaded, ids: list[int], kv_name: str, decode_tail: int) -> torch.Tensor:
    model = loaded.model
    fmt = resolve_kv_cache_dtype(kv_name, loaded.dtype)
    n, bs = len(ids), 16
    blocks = list(range(1, 2 + n // bs))
    kv = allocate_kv_cache(model, len(blocks) + 1, bs, loaded.dtype, kv_format=fmt)
    caches = list(kv.unbind(0))
    out = []
    prefill_end = n - decode_tail
    steps = [(s, min(s + 96, prefill_end)) for s in range(0, prefill_end, 96)]
    steps += [(p, p + 1) for p in range(prefill_end, n)]
    with torch.inference_mode():
        for start, end in steps:
            meta = build_attention_metadata(
                [SeqSpec(0, end - start, end - start, start, blocks)],
                num_tokens=end - start,
                block_size=bs,
                kv_segment_size=64,
                backend="native",
                kv_dtype=loaded.dtype,
                kv_8bit=fmt.is_8bit,
            )
            hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), caches, meta)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kv_name", "min_agree", "max_err", "mean_err"),
    [("int8", 0.97, 5.0, 0.4), ("fp8_e4m3", 0.95, 6.0, 0.6)],
)
def test_kv8_tracks_bf16_kv(
    bf16_model, kv_name: str, min_agree: float, max_err: float, mean_err: float
) -> None:
    """Measured 2026-12-01: Q4_1 weights: int8 98.9 % agreement, max 3.24, mean 0.28;
    fp8 98.2 %, 3.94, 0.39. Float weights: int8 99.6 %, 2.66, 0.17; fp8 98.7 %, 3.54,
    0.33 (logits up to 39.5; bf16 weights vs HF fp32 are held to max 3.0, mean 0.3)."""
    agree_n = total = 0
    worst = mean = 0.0
    for text in TEXTS:
        ids = bf16_model.tokenizer(text * 4)["input_ids"][:240]
        ref = _logits(bf16_model, ids, "bfloat16", decode_tail=24)
        got = _logits(bf16_model, ids, kv_name, decode_tail=24)
        agree_n += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
        worst = max(worst, (got - ref).abs().max().item())
        mean += (got - ref).abs().mean().item() / len(TEXTS)
    agree = agree_n / total
    print(f"{kv_name} vs bfloat16 KV: agreement {agree:.2%}, max err {worst:.3f}, mean {mean:.3f}")
    assert agree >= min_agree, f"{kv_name}: agreement {agree:.1%} below {min_agree:.0%}"
    assert 0.0 < worst < max_err, f"{kv_name}: max logit error {worst:.3f}"
    assert mean < mean_err, f"{kv_name}: mean logit error {mean:.3f}"
