"""bfloat16 (the default on CPUs with native bf16) stays close to HF transformers' fp32."""

from __future__ import annotations

import pytest
import torch
from support.prefill import chunked_prefill_logits

pytestmark = pytest.mark.usefixtures("single_thread_torch")

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
)


@pytest.mark.parametrize("backend", ["native", "portable"])
def test_bf16_logits_track_hf_float32(hf_model, loaded_model, backend: str) -> None:
    from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model

    bf16 = load_model(DEFAULT_MODEL_NAME, dtype="bfloat16", quantization="none")
    model = bf16.model
    assert model.embed_tokens.dtype == torch.bfloat16
    ids = loaded_model.tokenizer(TEXT * 12)["input_ids"][:300]
    got = chunked_prefill_logits(
        model, ids, chunk=128, backend=backend, kv_dtype=torch.bfloat16
    )  # chunked, so later chunks read bf16 pages from the cache
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert got.dtype == torch.float32, "logits reach the sampler in float32"
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    err = (got - ref).abs()
    assert agree >= 0.97, f"bf16 next-token agreement with HF fp32 only {agree:.1%}"
    assert got[-1].argmax() == ref[-1].argmax()
    assert err.max().item() < 3.0 and err.mean().item() < 0.3, (err.max(), err.mean())
