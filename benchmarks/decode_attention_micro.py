"""Decode attention alone (the native kernel, no Python layer), against read bandwidth.

Calls the paged-attention kernel directly for ``rows`` decode rows of ``context``
keys, SmolLM2-135M's shape by default (9 query heads over 3 KV heads, head_dim 64),
blocks scattered at random, one distinct cache per layer (``layers`` of them, so the
step streams its KV from memory) and reports KV bytes read / time against the
machine's read bandwidth (a large tensor's sum), for 1 and 2 threads, bf16 and fp32.
A benchmark, not a test: nothing here asserts. Run::

    PYTHONPATH=$PWD python benchmarks/decode_attention_micro.py [--contexts 1024,4096]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvserve.bench.attention_bench import read_bandwidth_gb_s


def _kernel():  # type: ignore[no-untyped-def]
    from kvserve.model.kernels.backend import default_backend

    k = default_backend().attention
    if k is None:
        raise SystemExit("the native kernels do not build here")
    return k


def time_decode(
    kernel,  # type: ignore[no-untyped-def]
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
    repeats: int = 5,
) -> tuple[float, int]:
    """Median seconds of one step (``layers`` kernel calls) and the KV bytes it reads."""
    per_req = -(-context // block_size)
    num_blocks = 1 + rows * per_req
    gen = torch.Generator().manual_seed(0)
    shape = (2, kv_heads, num_blocks, block_size, head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    tables = torch.tensor([[free.pop() for _ in range(per_req)] for _ in range(rows)])
    seqs = torch.tensor([[i, 1, 1, context - 1, 0] for i in range(rows)], dtype=torch.int64)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for c in caches:
            kernel(q, c, seqs, tables, segment, head_dim**-0.5)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for c in caches:
                kernel(q, c, seqs, tables, segment, head_dim**-0.5)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    kv_bytes = layers * rows * context * kv_heads * head_dim * 2 * caches[0].element_size()
    return statistics.median(times), kv_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args()
    kernel = _kernel()
    bw = {t: 0.0 for t in map(int, args.threads.split(","))}
    for t in bw:
        torch.set_num_threads(t)
        bw[t] = read_bandwidth_gb_s()
    print("read bandwidth GB/s: " + ", ".join(f"{t} thr {b:.1f}" for t, b in bw.items()))
    print(f"{'dtype':<6}{'ctx':>6}{'thr':>4}{'step ms':>9}{'GB/s':>7}{'of bw':>7}")
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    for name in args.dtypes.split(","):
        for ctx in map(int, args.contexts.split(",")):
            for t in bw:
                s, nbytes = time_decode(
                    kernel,
                    dtype=dtypes[name],
                    rows=args.rows,
                    context=ctx,
                    threads=t,
                    layers=args.layers,
                )
                gbs = nbytes / s / 1e9
                print(f"{name:<6}{ctx:>6}{t:>4}{s * 1e3:>9.2f}{gbs:>7.1f}{gbs / bw[t]:>7.0%}")


if __name__ == "__main__":
    main()
