"""K-quant linears (kq4/kq5/kq6, csrc/linear_kquant.cpp) against the q4_1 / q8_0 kernel
on one weight shape: time per call and weight bytes streamed per second, formats
interleaved per round (timings on a shared machine: compare ratios within one run).

    python benchmarks/kquant_linear.py [--n 2048] [--k 2048] [--rows 1,8,64] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvserve.model.quant.formats import QuantWeight, quantize_4bit, quantize_symmetric8
from kvserve.model.quant.kernel import get_quant_kernel
from kvserve.model.quant.kquant import GGUF_BLOCK_BYTES, from_gguf


def _kquant(type_name: str, n: int, k: int, rng: np.random.Generator) -> QuantWeight:
    raw = rng.integers(0, 256, size=(n * k // 256, GGUF_BLOCK_BYTES[type_name]), dtype=np.uint8)
    for off in [208] if type_name == "Q6_K" else [0, 2]:
        vals = rng.uniform(1e-3, 2e-2, size=(len(raw), 1)).astype(np.float16)
        raw[:, off : off + 2] = vals.view(np.uint8)
    return from_gguf(raw, type_name, n, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = get_quant_kernel()
    if kernel is None:
        raise SystemExit("native kernels unavailable")
    rng = np.random.default_rng(0)
    wf = torch.randn(args.n, args.k)
    weights = {t: _kquant(t, args.n, args.k, rng) for t in ("Q4_K", "Q5_K", "Q6_K")}
    weights["q4_1"] = quantize_4bit(wf)
    weights["q8_0"] = quantize_symmetric8(wf)
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, args.k)
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, w in weights.items():
                kernel.linear(x, w)
                t0 = time.process_time()
                for _ in range(args.calls):
                    kernel.linear(x, w)
                dt = (time.process_time() - t0) / args.calls
                best[name] = min(best.get(name, dt), dt)
        for name, dt in best.items():
            w = weights[name]
            print(
                f"M={m:3d} {name:5s} {dt * 1e3:8.3f} ms  {w.nbytes / dt / 1e9:6.1f} GB/s  "
                f"{w.nbytes / (w.n * w.k):.4f} B/weight"
            )


if __name__ == "__main__":
    main()
