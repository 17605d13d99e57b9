"""Decode per KV cache format against the memory-bandwidth limit
(``kvserve bench forward --kv-formats auto,int8,fp8_e4m3``).

Two measurements per format:

- **attention**: a decode step's paged attention alone (all layers, the step's KV
  write included) at each ``--attention-batches`` × ``--attention-contexts``, on
  caches with the requests' blocks where the engine's allocator puts them
  (``placement="engine"``, :func:`kvserve.bench.kv_placement.engine_block_tables`;
  ``"random"``: every block anywhere, the worst case), one cache per layer up to
  :data:`CACHE_SPAN_BYTES` (so the KV streams from memory). The formats are timed
  interleaved, one step of each per round, so a noisy machine slows them alike; the
  ratio to the bfloat16 (float) row is the figure to read.
- **decode**: whole-model decode tokens/s at ``--decode-batches`` (the ModelRunner
  with ``kv_cache_dtype`` set), and its floor ``(weight bytes + KV bytes read) /
  read bandwidth`` over the measured step (``fraction_of_bandwidth``).

KV bytes count what each format stores per token row: ``head_dim × element size``
for float caches, ``head_dim + 4`` (codes and an fp32 scale) for 8-bit ones. A
benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

CACHE_SPAN_BYTES = 512 << 20  # per format: layers cycle through at most this much KV


def _caches(fmt: Any, shape: tuple[int, ...], model_dtype: Any, count: int, gen: Any) -> list[Any]:
    import torch

    from kvserve.model.kernels.kv8 import quantize_cache

    out = []
    for _ in range(count):
        x = torch.randn(shape, generator=gen)
        out.append(quantize_cache(x, fmt.torch_dtype) if fmt.is_8bit else x.to(model_dtype))
    return out


def _tables(placement: str, batch: int, context: int, block_size: int) -> list[list[int]]:
    """Block tables of ``batch`` requests of ``context + 1`` tokens, placed as named."""
    from kvserve.bench.kv_placement import engine_block_tables

    if placement == "engine":
        return engine_block_tables(batch, context, block_size=block_size)
    if placement != "random":
        raise ValueError(f"placement={placement!r}: must be 'engine' or 'random'")
    per_req = -(-(context + 1) // block_size)
    free = list(range(1, 1 + batch * per_req))
    random.Random(0).shuffle(free)
    return [[free.pop() for _ in range(per_req)] for _ in range(batch)]


def attention_rows(
    arch: Any,
    model_dtype: Any,
    kv_names: Sequence[str],
    batches: Sequence[int],
    contexts: Sequence[int],
    bandwidth_gb_s: float,
    rounds: int = 7,
    block_size: int = 16,
    clock: Callable[[], float] = time.perf_counter,
    placement: str = "engine",
) -> list[dict[str, Any]]:
    """Median decode-attention step per format (interleaved rounds) for each batch and
    context; ``vs_first``: the first format's step time over this one's. ``placement``:
    ``engine`` or ``random`` (see the module doc)."""
    import torch

    from kvserve.model.attention import SeqSpec, build_attention_metadata, paged_attention
    from kvserve.model.kernels.kv8 import resolve_kv_cache_dtype

    fmts = [resolve_kv_cache_dtype(n, model_dtype) for n in kv_names]
    hk, h, d, layers = arch.num_kv_heads, arch.num_heads, arch.head_dim, arch.num_layers
    rows: list[dict[str, Any]] = []
    for context in contexts:
        for batch in batches:
            tables = _tables(placement, batch, context, block_size)
            num_blocks = 1 + max(b for t in tables for b in t)
            specs = [SeqSpec(i, 1, 1, context, tables[i]) for i in range(batch)]
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(batch, h, d, generator=gen).to(model_dtype)
            k = torch.randn(batch, hk, d, generator=gen).to(model_dtype)
            v = torch.randn(batch, hk, d, generator=gen).to(model_dtype)
            setups = []
            for fmt in fmts:
                shape = (2, hk, num_blocks, block_size, fmt.last_dim(d))
                cache_bytes = 2 * hk * num_blocks * block_size * fmt.row_bytes(d)
                n = max(1, min(layers, CACHE_SPAN_BYTES // cache_bytes))
                meta = build_attention_metadata(
                    specs,
                    num_tokens=batch,
                    block_size=block_size,
                    kv_segment_size=512,
                    backend="native",
                    kv_dtype=model_dtype,
                    kv_8bit=fmt.is_8bit,
                )
                shape_d = (2, hk, num_blocks, block_size, d)
                caches = _caches(fmt, shape_d, model_dtype, n, gen)
                assert caches[0].shape == shape
                setups.append((fmt, caches, meta))
            times: list[list[float]] = [[] for _ in fmts]
            scale = d**-0.5
            with torch.inference_mode():
                for _, caches, meta in setups:  # warm-up, first touch
                    for c in caches:
                        paged_attention(q, k, v, c, meta, scale)
                for _ in range(rounds):
                    for i, (_, caches, meta) in enumerate(setups):
                        t0 = clock()
                        for layer in range(layers):
                            paged_attention(q, k, v, caches[layer % len(caches)], meta, scale)
                        times[i].append(clock() - t0)
            first = statistics.median(times[0])
            for i, (fmt, caches, _) in enumerate(setups):
                step = statistics.median(times[i])
                kv_bytes = layers * batch * (context + 1) * hk * 2 * fmt.row_bytes(d)
                limit = kv_bytes / (bandwidth_gb_s * 1e9)
                rows.append(
                    {
                        "kv_format": fmt.name,
                        "batch": batch,
                        "context": context,
                        "placement": placement,
                        "step_ms": step * 1e3,
                        "vs_first": first / step,
                        "kv_mb": kv_bytes / 1e6,
                        "limit_ms": limit * 1e3,
                        "fraction_of_bandwidth": limit / step,
                        "num_caches": len(caches),
                    }
                )
    return rows


def decode_rows(
    loaded: Any,
    kv_names: Sequence[str],
    driver_factory: Callable[[Any, str], Any],
    batches: Sequence[int],
    context: int,
    steps: int,
    bandwidth_gb_s: float,
    clock: Callable[[], float],
    prompts: Callable[[int, int], list[list[int]]],
) -> list[dict[str, Any]]:
    """Whole-model decode per KV format: median step per batch, tok/s, and the
    fraction of the (weights + KV) bandwidth limit. ``driver_factory(loaded, name)``
    builds a runner driver with ``kv_cache_dtype=name``."""
    from kvserve.bench.weight_formats import median_decode_step, streamed_weight_bytes
    from kvserve.model.kernels.kv8 import resolve_kv_cache_dtype

    weights = streamed_weight_bytes(loaded.model)
    c = loaded.model.config
    rows = []
    for name in kv_names:
        fmt = resolve_kv_cache_dtype(name, loaded.dtype)
        drv = driver_factory(loaded, name)
        for batch in batches:
            step = median_decode_step(drv, prompts(batch, context), steps, clock)
            kv = batch * (context + steps // 2) * c.num_layers * 2 * c.num_kv_heads
            kv *= fmt.row_bytes(c.head_dim)
            limit = (weights + kv) / (bandwidth_gb_s * 1e9)
            rows.append(
                {
                    "kv_format": fmt.name,
                    "batch": batch,
                    "step_ms": step * 1e3,
                    "tok_s": batch / step,
                    "stream_mb": (weights + kv) / 1e6,
                    "limit_ms": limit * 1e3,
                    "fraction_of_bandwidth": limit / step,
                }
            )
        del drv
    return rows


def print_rows(result: dict[str, Any]) -> None:
    bw = result["read_bandwidth_gb_s"]
    print(f"decode attention by KV format (all layers, interleaved), read bandwidth {bw:.1f} GB/s:")
    print(
        f"{'kv':<10}{'batch':>6}{'context':>9}{'step ms':>10}{'vs first':>10}{'KV MB':>9}"
        f"{'limit ms':>10}{'of BW':>7}"
    )
    for r in result["attention"]:
        print(
            f"{r['kv_format']:<10}{r['batch']:>6}{r['context']:>9}{r['step_ms']:>10.2f}"
            f"{r['vs_first']:>9.2f}x{r['kv_mb']:>9.1f}{r['limit_ms']:>10.2f}"
            f"{r['fraction_of_bandwidth']:>7.0%}"
        )
    print("decode by KV format (whole model; weights + KV bytes per step):")
    print(
        f"{'kv':<10}{'batch':>6}{'step ms':>10}{'tok/s':>9}{'stream MB':>11}{'limit ms':>10}"
        f"{'of BW':>7}"
    )
    for r in result["decode"]:
        print(
            f"{r['kv_format']:<10}{r['batch']:>6}{r['step_ms']:>10.2f}{r['tok_s']:>9.1f}"
            f"{r['stream_mb']:>11.1f}{r['limit_ms']:>10.2f}{r['fraction_of_bandwidth']:>7.0%}"
        )
