"""Decode attention per step, against the memory-bandwidth limit (``kvserve bench forward``).

For each batch × context × placement it builds paged KV caches and times a decode
step's :func:`~kvserve.model.attention.paged_attention` (KV write included) layer
after layer. The placement of the requests' blocks (:data:`PLACEMENTS`): ``engine``,
the block tables the engine's own allocator gives them (the real scheduler and KV
cache manager: prompts admitted together, chunked prefill, decodes growing beside
the later prompts; :func:`kvserve.bench.kv_placement.engine_block_tables`);
``engine-churn``, the same after an earlier generation of requests ran and was freed
(prefix caching on: the new one also evicts cached blocks, in LRU order); ``random``,
every block at a random place, the worst case. Each row reports the mean fraction of
adjacent block pairs in its tables (``adjacent_blocks``). As in a served model, the
layers' caches are distinct, so the step streams its KV from memory rather than
from the CPU's caches: one cache per layer up to :data:`CACHE_SPAN_BYTES` in all (the layers then cycle through them, still far more
than any last-level cache), on transparent huge pages like the engine's KV pool
(:mod:`kvserve.model.hugepages`). The bandwidth limit is the K and V bytes the step
must read (``layers × batch × (context + 1) × kv_heads × head_dim × 2 × element
size``) divided by this machine's read bandwidth, measured RIGHT BESIDE the step:
before every timed repeat of a row, the native kernels' stream read
(:meth:`PagedAttention.read_slices`: 512-bit loads, one slice per thread, the step's
own thread count and clock) of a huge-page buffer as large as the KV the step
touches (its caches' bytes), so that machine load, frequency and cache residency
affect both alike; the row's limit uses the median of its own samples and the row
reports their spread (min, max). ``fraction = limit_ms / measured_ms``. Beside it,
the plain read of exactly the step's K/V pages in the kernel's order
(:meth:`PagedAttention.read_pages`, also interleaved): the access pattern's own
limit (on AMD Zen 5 one core reads random 2 KB pieces at about half its stream
rate, whatever the prefetching). A large tensor's ``torch.sum`` (4 KB pages) is
reported for comparison with older figures. A benchmark, not a test: nothing here
asserts.
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
# Block placements a row can use (see the module doc).
PLACEMENTS = ("engine", "engine-churn", "random")


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
    limit_reads: bool = False,
    placement: str = "random",
) -> dict[str, Any]:
    """Time one decode step's attention (all layers, median of ``repeats``) for
    ``batch`` rows of ``context``, the blocks placed as ``placement`` says (one of
    :data:`PLACEMENTS`; ValueError otherwise). With ``limit_reads`` (and the native
    kernels built) every repeat is preceded by the limit's reads on the same threads and clock: the
    stream read of a huge-page buffer as large as the step's caches
    (``stream_read_gb_s``: one sample per repeat) and the read of the step's own pages
    (``page_read_ms``: their median)."""
    import torch

    from kvserve.bench.kv_placement import adjacent_fraction, engine_block_tables
    from kvserve.model.attention import SeqSpec, build_attention_metadata, paged_attention
    from kvserve.model.hugepages import zeros_hugepages

    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: must be one of {PLACEMENTS}")
    per_req = -(-(context + 1) // block_size)
    if placement == "random":
        num_blocks = 1 + batch * per_req
        free = list(range(1, num_blocks))
        random.Random(0).shuffle(free)
        tables = [[free.pop() for _ in range(per_req)] for _ in range(batch)]
    else:
        tables = engine_block_tables(
            batch, context, block_size=block_size, churn=placement == "engine-churn"
        )
        num_blocks = 1 + max(b for t in tables for b in t)
    gen = torch.Generator().manual_seed(0)
    cache_shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
    cache_bytes = torch.Size(cache_shape).numel() * torch.empty((), dtype=dtype).element_size()
    num_caches = max(1, min(num_layers, CACHE_SPAN_BYTES // cache_bytes))
    caches = []
    for _ in range(num_caches):
        c = zeros_hugepages(*cache_shape, dtype=dtype)
        caches.append(c.copy_(torch.randn(cache_shape, generator=gen)))
    specs = [SeqSpec(i, 1, 1, context, tables[i]) for i in range(batch)]
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
    reads = _LimitReads.make(caches, meta, num_layers) if limit_reads else None
    with torch.inference_mode():
        for kv_cache in caches:  # warm-up (and first touch of every page)
            paged_attention(q, k, v, kv_cache, meta, scale)
        if reads is not None:
            reads.sample(clock)  # warm-up (first touch of the stream buffer)
            reads.stream_gb_s.clear()
            reads.pages_s.clear()
        times = []
        for _ in range(repeats):
            if reads is not None:
                reads.sample(clock)
            t0 = clock()
            for layer in range(num_layers):
                paged_attention(q, k, v, caches[layer % num_caches], meta, scale)
            times.append(clock() - t0)
    step_s = statistics.median(times)
    elem = kv_cache.element_size()
    kv_bytes = num_layers * batch * (context + 1) * num_kv_heads * head_dim * 2 * elem
    out: dict[str, Any] = {
        "batch": batch,
        "context": context,
        "placement": placement,
        "adjacent_blocks": sum(adjacent_fraction(t) for t in tables) / len(tables),
        "backend": "native" if meta.native is not None else "portable",
        "step_ms": step_s * 1e3,
        "step_ms_spread": [min(times) * 1e3, max(times) * 1e3],
        "num_caches": num_caches,
        "kv_bytes": kv_bytes,
    }
    if reads is not None:
        out["stream_read_gb_s"] = reads.stream_gb_s
        out["stream_read_bytes"] = reads.stream_bytes
        out["page_read_ms"] = statistics.median(reads.pages_s) * 1e3
    return out


class _LimitReads:
    """The limit's reads beside one row's timings (see :func:`decode_attention_step`)."""

    def __init__(self, kernel: Any, buf: Any, caches: list[Any], meta: Any, layers: int) -> None:
        import torch

        self.kernel = kernel
        self.buf = buf
        self.stream_bytes = buf.numel() * buf.element_size()
        self.caches = caches
        self.seqs = meta.native.seqs
        self.tables = meta.native.block_tables
        self.layers = layers
        self.threads = torch.get_num_threads()
        self.stream_gb_s: list[float] = []
        self.pages_s: list[float] = []

    @classmethod
    def make(cls, caches: list[Any], meta: Any, layers: int) -> _LimitReads | None:
        """None where the native kernels are unavailable or the step does not use them."""
        import torch

        from kvserve.model.hugepages import zeros_hugepages
        from kvserve.model.kernels.backend import default_backend

        kernel = default_backend().attention
        if kernel is None or meta.native is None:
            return None
        cache_bytes = sum(c.numel() * c.element_size() for c in caches)
        buf = zeros_hugepages(max(1 << 20, cache_bytes) // 4, dtype=torch.float32)
        return cls(kernel, buf, caches, meta, layers)

    def sample(self, clock: Callable[[], float]) -> None:
        t0 = clock()
        self.kernel.read_slices(self.buf, self.threads)
        self.stream_gb_s.append(self.stream_bytes / (clock() - t0) / 1e9)
        t0 = clock()
        for layer in range(self.layers):
            c = self.caches[layer % len(self.caches)]
            self.kernel.read_pages(c, self.seqs, self.tables, self.threads)
        self.pages_s.append(clock() - t0)


def run_attention_grid(
    arch: Any,
    dtype: Any,
    batches: Sequence[int],
    contexts: Sequence[int],
    backends: Sequence[str],
    clock: Callable[[], float] = time.perf_counter,
    repeats: int = 7,
    placements: Sequence[str] = ("engine", "random"),
) -> dict[str, Any]:
    """Every batch × context × backend × placement (median of ``repeats`` steps; the
    placements of one batch × context run one after the other), each native row
    against its own limit measured beside it (:func:`decode_attention_step` with
    ``limit_reads``): ``read_bandwidth_gb_s`` (median of the row's stream reads),
    ``read_bandwidth_spread`` (their min, max), ``fraction_of_bandwidth``, and
    ``fraction_of_page_read`` (the step's time over the plain read of its own pages).
    Rows without native reads (the portable backend, or no native kernels) use the
    median of every sample taken, or torch's sum where there is none. The top level
    keeps ``read_bandwidth_gb_s`` (the median over all rows' samples) and their spread."""
    import torch

    torch_sum = read_bandwidth_gb_s()
    rows = []
    for backend in backends:
        for context in contexts:
            for batch in batches:
                for placement in placements:
                    r = decode_attention_step(
                        num_layers=arch.num_layers,
                        num_heads=arch.num_heads,
                        num_kv_heads=arch.num_kv_heads,
                        head_dim=arch.head_dim,
                        dtype=dtype,
                        batch=batch,
                        context=context,
                        backend=backend,
                        repeats=repeats,
                        clock=clock,
                        limit_reads=True,
                        placement=placement,
                    )
                    rows.append(r)
    samples = [x for r in rows for x in r.get("stream_read_gb_s", [])]
    bw = statistics.median(samples) if samples else torch_sum
    for r in rows:
        own = r.get("stream_read_gb_s") or []
        row_bw = statistics.median(own) if own else bw
        r["read_bandwidth_gb_s"] = row_bw
        r["read_bandwidth_spread"] = [min(own), max(own)] if own else None
        r["limit_ms"] = r["kv_bytes"] / (row_bw * 1e9) * 1e3
        r["fraction_of_bandwidth"] = r["limit_ms"] / r["step_ms"]
        if "page_read_ms" in r:
            r["fraction_of_page_read"] = r["page_read_ms"] / r["step_ms"]
    return {
        "read_bandwidth_gb_s": bw,
        "read_bandwidth_spread": [min(samples), max(samples)] if samples else None,
        "torch_sum_gb_s": torch_sum,
        "stream_read_gb_s": samples,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0],
        "rows": rows,
    }


def print_attention_table(result: dict[str, Any]) -> None:
    spread = result.get("read_bandwidth_spread")
    spread_s = f" [{spread[0]:.1f}-{spread[1]:.1f}]" if spread else ""
    print(
        f"decode attention per step (all layers), read bandwidth "
        f"{result['read_bandwidth_gb_s']:.1f}{spread_s} GB/s (native stream read beside each "
        f"row, huge pages, as large as the row's KV, {result.get('threads', '?')} threads; "
        f"torch sum {result.get('torch_sum_gb_s', float('nan')):.1f} GB/s; load average "
        f"{result.get('load_average', float('nan')):.1f}):"
    )
    print(
        f"{'backend':<10}{'placement':<14}{'adjacent':>9}{'batch':>6}{'context':>9}"
        f"{'step ms':>10}{'KV MB':>8}"
        f"{'GB/s':>7}{'bw GB/s':>15}{'limit ms':>10}{'of limit':>10}{'of pages':>10}"
    )
    for r in result["rows"]:
        bw = r.get("read_bandwidth_gb_s", result["read_bandwidth_gb_s"])
        sp = r.get("read_bandwidth_spread")
        bw_s = f"{bw:.1f} [{sp[0]:.0f}-{sp[1]:.0f}]" if sp else f"{bw:.1f}"
        pages = r.get("fraction_of_page_read")
        print(
            f"{r['backend']:<10}{r.get('placement', 'random'):<14}"
            f"{r.get('adjacent_blocks', float('nan')):>9.0%}{r['batch']:>6}{r['context']:>9}{r['step_ms']:>10.2f}"
            f"{r['kv_bytes'] / 1e6:>8.1f}{r['kv_bytes'] / r['step_ms'] / 1e6:>7.1f}{bw_s:>15}"
            f"{r['limit_ms']:>10.2f}{r['fraction_of_bandwidth']:>9.0%}"
            f"{format(pages, '>9.0%') if pages is not None else '        -'}"
        )
