"""One request's prompt prefilled through a model in chunks over a fresh paged KV
cache, so that later chunks read the earlier ones' pages."""

from __future__ import annotations

import torch

from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.model.kv_cache_tensor import allocate_kv_cache
from kvserve.model.llama import LlamaForCausalLM


def chunked_prefill_logits(
    model: LlamaForCausalLM,
    ids: list[int],
    *,
    chunk: int,
    backend: str = "native",
    kv_dtype: torch.dtype = torch.float32,
    kv_segment_size: int = 64,
    block_size: int = 16,
    hidden_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The logits [len(ids), vocab] of ``ids`` as one request, ``chunk`` tokens a step,
    the KV cache in ``kv_dtype`` (the model's dtype) on blocks 1, 2, ... in order.
    ``hidden_dtype``: asserted as every step's hidden states' dtype where given."""
    n = len(ids)
    blocks = list(range(1, 2 + n // block_size))
    kv = allocate_kv_cache(model, len(blocks) + 1, block_size, kv_dtype)
    assert kv.dtype == kv_dtype, "the KV cache is kept in the dtype asked for"
    out = []
    with torch.inference_mode():
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            meta = build_attention_metadata(
                [SeqSpec(0, end - start, end - start, start, blocks)],
                num_tokens=end - start,
                block_size=block_size,
                kv_segment_size=kv_segment_size,
                backend=backend,  # type: ignore[arg-type]
                kv_dtype=kv_dtype,
            )
            hidden = model(
                torch.tensor(ids[start:end]), torch.arange(start, end), list(kv.unbind(0)), meta
            )
            assert hidden_dtype is None or hidden.dtype == hidden_dtype
            out.append(model.compute_logits(hidden))
    return torch.cat(out)
