"""One request's prompt prefilled through a model in chunks over a fresh paged KV
cache, so that later chunks read the earlier ones' pages; and the hypothesis strategy
of prefill-heavy attention steps the prefill kernels' tests draw from."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

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


@st.composite
def prefill_heavy_steps(
    draw: st.DrawFn,
    *,
    block_sizes: list[int],
    kv_heads: list[int],
    group_sizes: list[int],
    head_dims: list[int],
    max_cached: int,
    max_chunk: int,
    max_decode_context: int,
) -> dict[str, Any]:
    """A case for ``model.test_attention.random_step``: up to 3 prefill chunks of 1 to
    ``max_chunk`` rows over up to ``max_cached`` cached tokens (and 0-5 prior-only
    rows), beside up to 3 decodes over up to ``max_decode_context`` tokens and up to 2
    dummy rows; block size, KV heads, query heads per KV head and head_dim from the
    lists; KV segment 0, 64 or 512."""
    num_kv_heads = draw(st.sampled_from(kv_heads))
    return dict(
        block_size=draw(st.sampled_from(block_sizes)),
        kv_segment_size=draw(st.sampled_from([0, 64, 512])),
        num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * draw(st.sampled_from(group_sizes)),
        head_dim=draw(st.sampled_from(head_dims)),
        prefills=draw(
            st.lists(
                st.tuples(st.integers(0, max_cached), st.integers(1, max_chunk), st.integers(0, 5)),
                min_size=1,
                max_size=3,
            )
        ),
        decodes=draw(st.lists(st.integers(0, max_decode_context), max_size=3)),
        num_dummy=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
