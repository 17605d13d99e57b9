"""bfloat16 (the default on CPUs with native bf16) stays close to HF transformers' fp32."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.worker.model_runner import allocate_kv_cache

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
    n, bs = len(ids), 16
    blocks = list(range(1, 2 + n // bs))
    kv = allocate_kv_cache(model, len(blocks) + 1, bs, torch.bfloat16)
    assert kv.dtype == torch.bfloat16, "the KV cache is kept in the model dtype"
    with torch.inference_mode():
        logits = []
        for start in range(0, n, 128):  # chunked, so later chunks read bf16 pages from the cache
            end = min(start + 128, n)
            meta = build_attention_metadata(
                [SeqSpec(0, end - start, end - start, start, blocks)],
                num_tokens=end - start,
                block_size=bs,
                kv_segment_size=64,
                backend=backend,  # type: ignore[arg-type]
                kv_dtype=torch.bfloat16,
            )
            hidden = model(
                torch.tensor(ids[start:end]), torch.arange(start, end), list(kv.unbind(0)), meta
            )
            logits.append(model.compute_logits(hidden))
        got = torch.cat(logits)
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert got.dtype == torch.float32, "logits reach the sampler in float32"
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    err = (got - ref).abs()
    assert agree >= 0.97, f"bf16 next-token agreement with HF fp32 only {agree:.1%}"
    assert got[-1].argmax() == ref[-1].argmax()
    assert err.max().item() < 3.0 and err.mean().item() < 0.3, (err.max(), err.mean())
