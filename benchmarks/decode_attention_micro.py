"""Decode attention alone (the native kernel, no Python layer), against read bandwidth.

Calls the paged-attention kernel directly for ``rows`` decode rows of ``context``
keys, SmolLM2-135M's shape by default (9 query heads over 3 KV heads, head_dim 64),
blocks scattered at random, one distinct cache per layer (``layers`` of them, so the
step streams its KV from memory). Each repeat runs, back to back on the same
threads: a stream read of a 512 MB buffer (``read_slices``: 512-bit loads, one slice
per thread), a read of exactly the step's K/V pages in the kernel's task order
(``read_pages``: the access pattern's own limit), and the kernel itself (each
``--lib`` in turn, for A/B comparisons of builds). Reported: medians, the kernel's
GB/s, its fraction of the stream read (``of bw``), of the page read (``of pages``),
the step with every layer on one cache (``hot ms``: the KV stays in the CPU's caches
while it fits, e.g. 3 MB at 1 row x 4k bf16, so the kernel's arithmetic alone) and
the fraction of the huge-page stream limit that time reaches (``ceiling``: no
placement or prefetching can take the kernel past it),
and for each extra library its step time over the first's (interleaved, so a loaded
machine slows all alike). A benchmark, not a test: nothing here asserts. Run::

    PYTHONPATH=$PWD python benchmarks/decode_attention_micro.py [--contexts 1024,4096]
    # A/B: build another paged_attention.cpp into a library and compare
    g++ -O3 -march=native -fopenmp -shared -fPIC -std=c++17 -o /tmp/old.so old.cpp
    PYTHONPATH=$PWD python benchmarks/decode_attention_micro.py --lib /tmp/old.so
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvserve.model.hugepages import zeros_hugepages
from kvserve.model.kernels.paged_attention import PagedAttention


def _kernels(extra: list[str]) -> list[tuple[str, PagedAttention]]:
    from kvserve.model.kernels.backend import default_backend

    k = default_backend().attention
    if k is None:
        raise SystemExit("the native kernels do not build here")
    return [("tree", k)] + [(os.path.basename(p), _attention_only(p)) for p in extra]


def _attention_only(path: str) -> PagedAttention:
    """The attention call of another build (which may predate the read functions)."""
    from kvserve.model.kernels._ctypes import CFunction
    from kvserve.model.kernels.paged_attention import _PARAMS

    k = PagedAttention.__new__(PagedAttention)
    k._fn = CFunction(ctypes.CDLL(path), "kvs_paged_attention", _PARAMS)
    return k


def time_decode(
    kernels: list[tuple[str, PagedAttention]],
    *,
    dtype: torch.dtype,
    rows: int,
    context: int,
    threads: int,
    layers: int = 30,
    heads: int = 9,
    kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    segment: int = 512,
    repeats: int = 7,
    stream_bytes: int = 512 << 20,
    clock: Callable[[], float] = time.perf_counter,
    placement: str = "random",
) -> dict[str, float]:
    """Median seconds of one step (``layers`` calls) per kernel, of the stream read of
    ``stream_bytes`` and of the page read, and the step's KV bytes. ``placement``:
    ``random`` (every block anywhere) or ``runs`` (each request's blocks one run of
    consecutive ids, as the engine's allocator lays them out)."""
    per_req = -(-context // block_size)
    num_blocks = 1 + rows * per_req
    gen = torch.Generator().manual_seed(0)
    shape = (2, kv_heads, num_blocks, block_size, head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]
    huge = []  # the same caches on transparent huge pages (the engine's KV pool)
    for c in caches:
        h = zeros_hugepages(*shape, dtype=dtype)
        huge.append(h.copy_(c))
    free = list(range(1, num_blocks))
    if placement == "random":
        random.Random(0).shuffle(free)
    else:
        free.reverse()  # popped from the end: ascending
    tables = torch.tensor([[free.pop() for _ in range(per_req)] for _ in range(rows)])
    seqs = torch.tensor([[i, 1, 1, context - 1, 0] for i in range(rows)], dtype=torch.int64)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    stream = torch.ones(stream_bytes // 4, dtype=torch.float32)
    stream_huge = zeros_hugepages(stream_bytes // 4, dtype=torch.float32).fill_(1.0)
    first = kernels[0][1]
    # every layer on one cache: the step with its KV in the CPU's caches (while it fits
    # there), so no memory stall: the kernel's arithmetic alone
    hot = [huge[0]] * layers
    old = torch.get_num_threads()
    torch.set_num_threads(threads)

    def step(kernel: PagedAttention, caches: list[torch.Tensor] = caches) -> float:
        t0 = clock()
        for c in caches:
            kernel(q, c, seqs, tables, segment, head_dim**-0.5)
        return clock() - t0

    def pages(caches: list[torch.Tensor] = caches) -> float:
        t0 = clock()
        for c in caches:
            first.read_pages(c, seqs, tables, threads)
        return clock() - t0

    def slices(buf: torch.Tensor = stream) -> float:
        t0 = clock()
        first.read_slices(buf, threads)
        return clock() - t0

    times: dict[str, list[float]] = {
        n: [] for n in ("stream", "pages", "huge", "huge_stream", "huge_pages", "hot")
    }
    times.update({n: [] for n, _ in kernels})
    try:
        for _, k in kernels:
            step(k)  # warm-up, first touch
        step(first, huge)
        pages(), slices()
        for rep in range(repeats):
            times["stream"].append(slices())
            times["pages"].append(pages())
            # the kernels in a rotating order: the one run right after the reads above
            # was measured 7-9 % slower than an identical build run next to it
            shift = rep % len(kernels)
            for name, k in kernels[shift:] + kernels[:shift]:
                times[name].append(step(k))
            times["huge_stream"].append(slices(stream_huge))
            times["huge_pages"].append(pages(huge))
            times["huge"].append(step(first, huge))
            times["hot"].append(step(first, hot))
    finally:
        torch.set_num_threads(old)
    out = {n: statistics.median(v) for n, v in times.items()}
    out["kv_bytes"] = layers * rows * context * kv_heads * head_dim * 2 * caches[0].element_size()
    out["stream_bytes"] = stream_bytes
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,16", help="decode rows, comma-separated")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--threads", default="2")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--placement",
        choices=("random", "runs"),
        default="random",
        help="blocks at random, or one run of consecutive ids per request",
    )
    p.add_argument("--lib", action="append", default=[], help="another build to compare")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time (with --threads 1: robust to other load)",
    )
    args = p.parse_args()
    kernels = _kernels(args.lib)
    print(f"load average {os.getloadavg()[0]:.2f}")
    others = "".join(f"{n[:10]:>11}" for n, _ in kernels[1:])
    print(
        f"{'dtype':<6}{'rows':>5}{'ctx':>6}{'thr':>4}{'step ms':>9}{'GB/s':>7}{'bw':>7}"
        f"{'of bw':>7}{'pages':>7}{'of pages':>9}  2M pages: {'step ms':>8}{'bw':>6}{'pages':>6}{'of bw':>6}"
        f"{'hot ms':>8}{'ceiling':>8}{others}"
    )
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    for name in args.dtypes.split(","):
        for rows in map(int, args.rows.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                for t in map(int, args.threads.split(",")):
                    r = time_decode(
                        kernels,
                        dtype=dtypes[name],
                        rows=rows,
                        context=ctx,
                        threads=t,
                        layers=args.layers,
                        repeats=args.repeats,
                        placement=args.placement,
                        clock=time.process_time if args.clock == "cpu" else time.perf_counter,
                    )
                    s = r["tree"]
                    gbs = r["kv_bytes"] / s / 1e9
                    bw = r["stream_bytes"] / r["stream"] / 1e9
                    pg = r["kv_bytes"] / r["pages"] / 1e9
                    h = r["kv_bytes"] / r["huge"] / 1e9
                    hbw = r["stream_bytes"] / r["huge_stream"] / 1e9
                    hpg = r["kv_bytes"] / r["huge_pages"] / 1e9
                    rel = "".join(f"{r[n] / s:>10.2f}x" for n, _ in kernels[1:])
                    print(
                        f"{name:<6}{rows:>5}{ctx:>6}{t:>4}{s * 1e3:>9.2f}{gbs:>7.1f}{bw:>7.1f}"
                        f"{gbs / bw:>7.0%}{pg:>7.1f}{gbs / pg:>9.0%}            {r['huge'] * 1e3:>8.2f}"
                        f"{hbw:>6.1f}{hpg:>6.1f}{h / hbw:>6.0%}"
                        f"{r['hot'] * 1e3:>8.2f}{r['kv_bytes'] / r['hot'] / 1e9 / hbw:>8.0%}{rel}",
                        flush=True,
                    )
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
