"""The fused decode step against the Python layer loop: a prefilled paged KV cache,
decode metadata, and the bitwise comparison (tests/model/test_fused_decode.py and the
quantized-weight tests that take the fused step).

Block size 16, KV segment 64; sequence ``s`` owns blocks ``1 + b*s .. b*(s+1)`` of a
cache with ``1 + b * len(lens)`` blocks (block 0 is the null block), ``b`` =
``blocks_per_seq``, which must hold each prompt plus the tokens decoded after it.
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.worker.model_runner import allocate_kv_cache

BS = 16


def prefilled(
    model: Any,
    dtype: torch.dtype,
    lens: list[int],
    *,
    vocab: tuple[int, int] = (100, 40000),
    blocks_per_seq: int = 4,
    seed: int = 0,
) -> tuple[torch.Tensor, list[torch.Tensor], list[list[int]]]:
    """A fresh cache with each request's prompt of ``lens[s]`` random ids in
    ``range(*vocab)`` (drawn in order from a generator seeded ``seed``) prefilled, one
    request per forward; returns (cache, its per-layer views, block tables)."""
    b = blocks_per_seq
    kv = allocate_kv_cache(model, 1 + b * len(lens), BS, dtype)
    caches = list(kv.unbind(0))
    tables = [list(range(1 + b * s, 1 + b * (s + 1))) for s in range(len(lens))]
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for s, n in enumerate(lens):
            ids = torch.randint(vocab[0], vocab[1], (n,), generator=gen)
            meta = build_attention_metadata(
                [SeqSpec(0, n, n, 0, tables[s])],
                num_tokens=n,
                block_size=BS,
                kv_segment_size=64,
                kv_dtype=dtype,
            )
            model(ids, torch.arange(n), caches, meta)
    return kv, caches, tables


def decode_meta(lens: list[int], tables: list[list[int]], dtype: torch.dtype) -> Any:
    """Metadata of one decode step: a row per request, after its ``lens[j]`` tokens."""
    specs = [SeqSpec(j, 1, 1, n, tables[j]) for j, n in enumerate(lens)]
    return build_attention_metadata(
        specs, num_tokens=len(lens), block_size=BS, kv_segment_size=64, kv_dtype=dtype
    )


def assert_fused_is_loop(
    model: Any,
    kv: torch.Tensor,
    caches: list[torch.Tensor],
    ids: torch.Tensor,
    pos: torch.Tensor,
    meta: Any,
    loop_meta: Any = None,
) -> None:
    """Run the step fused, then again from the same KV through the Python layer loop
    (``loop_meta``: fresh metadata for it, else ``meta``): bitwise the same hidden
    states and the same K/V rows written to the same slots. The model must take the
    fused step for ``meta``; it is left as it was."""
    fused = model._fused_decode
    assert fused is not None and fused.supports(meta, caches)
    kv_before = kv.clone()
    with torch.inference_mode():
        out_fused = model(ids, pos, caches, meta)
        kv_fused = kv.clone()
        kv.copy_(kv_before)
        model._fused_decode = None
        try:
            out_loop = model(ids, pos, caches, meta if loop_meta is None else loop_meta)
        finally:
            model._fused_decode = fused
    assert out_fused.dtype == torch.float32 and out_fused.shape == out_loop.shape
    assert torch.equal(out_fused, out_loop)
    assert torch.equal(kv_fused, kv) and not torch.equal(kv_fused, kv_before)
