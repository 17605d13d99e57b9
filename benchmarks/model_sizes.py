"""The quantized kernels at the shapes of 1B-8B models, against the machine's limits.

Decode (one row) reads every weight once, so its bar is the stream-read bandwidth;
prefill (``--prefill-rows`` rows) multiplies int8 activations with the weights' integer
codes, so its bar is the int8 dot-product peak. Each round, interleaved: a stream read
of ``--stream-mb`` (512-bit loads, one slice per thread: ``kvs_read_slices``), then per
format one-row calls on each linear of the shape, then prefill calls; medians over
rounds. ``--peak-gops`` is the int8 peak (``benchmarks/vnni_peak_probe.cpp`` prints it;
without it the prefill fraction is left out). Weight values are random: speed does not
depend on them.

    PYTHONPATH=. .venv/bin/python benchmarks/model_sizes.py --shape llama-3.1-8b --threads 2 \\
        --peak-gops 900
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvserve.model.kernels.backend import default_backend
from kvserve.model.quant.formats import QuantWeight, quantize_symmetric8
from kvserve.model.quant.kquant import GGUF_BLOCK_BYTES, from_gguf
from kvserve.model.synthetic import SHAPES, _quant_blocks


def _weight(fmt: str, n: int, k: int, rng: np.random.Generator) -> QuantWeight:
    kernel = default_backend().quant_linear
    if fmt == "q8_0":
        return quantize_symmetric8(torch.randn(n, k) * 0.02)
    raw = _quant_blocks(rng, fmt, n * k).reshape(n * k // 256, GGUF_BLOCK_BYTES[fmt])
    return from_gguf(raw, fmt, n, k, kernel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="Q4_K,Q6_K,q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill-rows", type=int, default=512)
    ap.add_argument("--stream-mb", type=int, default=1024)
    ap.add_argument("--peak-gops", type=float, default=0.0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    be = default_backend()
    if be.quant_linear is None or be.attention is None:
        raise SystemExit("native kernels unavailable")
    s = SHAPES[a.shape]
    hd = s.head_dim
    # one layer's linears (n, k): fused qkv, o, fused gate_up, down
    linears = [((s.heads + 2 * s.kv_heads) * hd, s.hidden), (s.hidden, s.heads * hd),
               (2 * s.intermediate, s.hidden), (s.hidden, s.intermediate)]  # fmt: skip
    rng = np.random.default_rng(0)
    fmts = a.formats.split(",")
    weights = {f: [_weight(f, n, k, rng) for n, k in linears] for f in fmts}
    buf = torch.ones((a.stream_mb << 20) // 4, dtype=torch.float32)
    x1 = {k: torch.randn(1, k) for _, k in linears}
    xp = {k: torch.randn(a.prefill_rows, k) for _, k in linears}
    stream: list[float] = []
    dec: dict[str, list[float]] = {f: [] for f in fmts}
    pre: dict[str, list[float]] = {f: [] for f in fmts}
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        be.attention.read_slices(buf, a.threads)
        stream.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        for f in fmts:
            for w in weights[f]:  # warm
                be.quant_linear.linear(x1[w.k], w)
            t0 = time.perf_counter()
            for _ in range(4):
                for w in weights[f]:
                    be.quant_linear.linear(x1[w.k], w)
            dec[f].append((time.perf_counter() - t0) / 4)
            t0 = time.perf_counter()
            for w in weights[f]:
                be.quant_linear.linear(xp[w.k], w)
            pre[f].append(time.perf_counter() - t0)
    bw = statistics.median(stream)
    flops = 2 * a.prefill_rows * sum(n * k for n, k in linears)
    print(f"{a.shape}: one layer's linears {linears}, {a.threads} threads, {a.rounds} rounds")
    print(f"stream read: {bw:.1f} GB/s (median; min {min(stream):.1f}, max {max(stream):.1f})")
    for f in fmts:
        nbytes = sum(w.nbytes for w in weights[f])
        d = statistics.median(dec[f])
        p = statistics.median(pre[f])
        gops = flops / p / 1e9
        frac = f", {gops / a.peak_gops:.0%} of the int8 peak" if a.peak_gops else ""
        print(f"{f:5s} decode {d * 1e3:7.2f} ms/layer  {nbytes / d / 1e9:5.1f} GB/s = "
              f"{nbytes / d / 1e9 / bw:.0%} of stream | prefill {a.prefill_rows} rows "
              f"{p * 1e3:8.1f} ms/layer  {gops:6.0f} GOPS{frac}")  # fmt: skip


if __name__ == "__main__":
    main()
