"""Decode attention per step, against the memory-bandwidth limit (``kvserve bench forward``).

For each batch × context it builds paged KV caches with every request's blocks
scattered at random (as after a while of serving) and times a decode step's
:func:`~kvserve.model.attention.paged_attention` (KV write included) layer after
layer. As in a served model, the layers' caches are distinct, so the step streams
its KV from memory rather than from the CPU's caches: one cache per layer up to
:data:`CACHE_SPAN_BYTES` in all (the layers then cycle through them, still far more
than any last-level cache), on transparent huge pages like the engine's KV pool
(:mod:`kvserve.model.hugepages`). The bandwidth limit is the K and V bytes the step
must read (``layers × batch × (context + 1) × kv_heads × head_dim × 2 × element
size``) divided by this machine's read bandwidth, measured fairly: the native
kernels' stream read (512-bit loads, one slice per thread, the same thread count,
a huge-page buffer like the caches; :meth:`PagedAttention.read_slices`), its median
taken between the rows so that machine load slows both alike: ``fraction = limit_ms /
measured_ms``. A large tensor's ``torch.sum`` (4 KB pages) is reported beside it for
comparison with older figures. A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

# KV caches the layers of one timed step cycle through, in bytes at most (one per
# layer while they fit): well past the last-level cache of any CPU this runs on.
CACHE_SPAN_BYTES = 1 << 30


def read_bandwidth_gb_s(num_bytes: int = 512 << 20, repeats: int = 7) -> float:
    """Read bandwidth of this machine (GB/s) from summing a ``num_bytes`` fp32 tensor."""
    import torch

    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times) / 1e9


def stream_read_gb_s(
    num_bytes: int = 512 << 20,
    repeats: int = 7,
    clock: Callable[[], float] = time.perf_counter,
) -> float | None:
    """Read bandwidth (GB/s, median) of the native stream read over a huge-page buffer
    on torch's thread count; None where the native kernels are unavailable."""
    import torch

    from kvserve.model.hugepages import zeros_hugepages
    from kvserve.model.kernels.backend import default_backend

    kernel = default_backend().attention
    if kernel is None:
        return None
    buf = zeros_hugepages(num_bytes // 4, dtype=torch.float32)
    threads = torch.get_num_threads()
    kernel.read_slices(buf, threads)
    times = []
    for _ in range(repeats):
        t0 = clock()
        kernel.read_slices(buf, threads)
        times.append(clock() - t0)
    return num_bytes / statistics.median(times) / 1e9


def decode_attention_step(
    *,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any,
    batch: int,
    context: int,
    backend: str = "auto",
    block_size: int = 16,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Time one decode step's attention (all layers, median of ``repeats``) for
    ``batch`` rows of ``context``."""
    import torch

    from kvserve.model.attention import SeqSpec, build_attention_metadata, paged_attention
    from kvserve.model.hugepages import zeros_hugepages

    per_req = -(-(context + 1) // block_size)
    num_blocks = 1 + batch * per_req
    gen = torch.Generator().manual_seed(0)
    cache_shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
    cache_bytes = torch.Size(cache_shape).numel() * torch.empty((), dtype=dtype).element_size()
    num_caches = max(1, min(num_layers, CACHE_SPAN_BYTES // cache_bytes))
    caches = []
    for _ in range(num_caches):
        c = zeros_hugepages(*cache_shape, dtype=dtype)
        caches.append(c.copy_(torch.randn(cache_shape, generator=gen)))
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    specs = [SeqSpec(i, 1, 1, context, [free.pop() for _ in range(per_req)]) for i in range(batch)]
    meta = build_attention_metadata(
        specs,
        num_tokens=batch,
        block_size=block_size,
        kv_segment_size=512,
        backend=backend,  # type: ignore[arg-type]
        kv_dtype=dtype,
    )
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, num_kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    with torch.inference_mode():
        for kv_cache in caches:  # warm-up (and first touch of every page)
            paged_attention(q, k, v, kv_cache, meta, scale)
        times = []
        for _ in range(repeats):
            t0 = clock()
            for layer in range(num_layers):
                paged_attention(q, k, v, caches[layer % num_caches], meta, scale)
            times.append(clock() - t0)
    step_s = statistics.median(times)
    elem = kv_cache.element_size()
    kv_bytes = num_layers * batch * (context + 1) * num_kv_heads * head_dim * 2 * elem
    return {
        "batch": batch,
        "context": context,
        "backend": "native" if meta.native is not None else "portable",
        "step_ms": step_s * 1e3,
        "num_caches": num_caches,
        "kv_bytes": kv_bytes,
    }


def run_attention_grid(
    arch: Any,
    dtype: Any,
    batches: Sequence[int],
    contexts: Sequence[int],
    backends: Sequence[str],
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Every batch × context × backend, plus the measured bandwidth and limits
    (``read_bandwidth_gb_s``: the native stream read, its median over measurements
    between the rows; torch's sum where the native kernels are unavailable)."""
    import torch

    torch_sum = read_bandwidth_gb_s()
    samples = [s for s in (stream_read_gb_s(clock=clock),) if s is not None]
    rows = []
    for backend in backends:
        for context in contexts:
            for batch in batches:
                r = decode_attention_step(
                    num_layers=arch.num_layers,
                    num_heads=arch.num_heads,
                    num_kv_heads=arch.num_kv_heads,
                    head_dim=arch.head_dim,
                    dtype=dtype,
                    batch=batch,
                    context=context,
                    backend=backend,
                    clock=clock,
                )
                rows.append(r)
                s = stream_read_gb_s(repeats=3, clock=clock)
                if s is not None:
                    samples.append(s)
    bw = statistics.median(samples) if samples else torch_sum
    for r in rows:
        r["limit_ms"] = r["kv_bytes"] / (bw * 1e9) * 1e3
        r["fraction_of_bandwidth"] = r["limit_ms"] / r["step_ms"]
    return {
        "read_bandwidth_gb_s": bw,
        "torch_sum_gb_s": torch_sum,
        "stream_read_gb_s": samples,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0],
        "rows": rows,
    }


def print_attention_table(result: dict[str, Any]) -> None:
    print(
        f"decode attention per step (all layers), read bandwidth "
        f"{result['read_bandwidth_gb_s']:.1f} GB/s (native stream read, huge pages, "
        f"{result.get('threads', '?')} threads; torch sum "
        f"{result.get('torch_sum_gb_s', float('nan')):.1f} GB/s; load average "
        f"{result.get('load_average', float('nan')):.1f}):"
    )
    print(
        f"{'backend':<10}{'batch':>6}{'context':>9}{'step ms':>10}{'KV MB':>8}"
        f"{'limit ms':>10}{'of limit':>10}"
    )
    for r in result["rows"]:
        print(
            f"{r['backend']:<10}{r['batch']:>6}{r['context']:>9}{r['step_ms']:>10.2f}"
            f"{r['kv_bytes'] / 1e6:>8.1f}{r['limit_ms']:>10.2f}"
            f"{r['fraction_of_bandwidth']:>9.0%}"
        )
