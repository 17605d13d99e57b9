"""A/B of the invariant prefill attention kernel (``kvs_prefill_attention_inv``,
csrc/prefill_vec.cpp) between two builds of prefill_vec.cpp, on one layer of
SmolLM2-135M's shape (3 KV heads x 3 query heads, head_dim 64, block 16, segment 512),
one whole prompt of n tokens per call, as ``kvserve bench forward`` prefills it.

Each build is compiled on its own (``g++ -O3 -march=native -fopenmp``) into a temporary
library; calls alternate between the builds (interleaved, so machine load hits both
alike) and the outputs are compared bit for bit (the two builds must compute the same
arithmetic). ``--clock cpu`` (process CPU time) with ``--threads 1`` is robust on a
shared machine; ``--clock wall`` for thread scaling.

    PYTHONPATH=. python benchmarks/prefill_inv_micro.py A.cpp B.cpp --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kvserve.model.kernels.prefill_vec import PrefillVec

BS, HK, G, D = 16, 3, 3, 64
CSRC = Path(__file__).resolve().parent.parent / "kvserve" / "model" / "csrc"


def build(src: Path, out_dir: Path, name: str) -> PrefillVec:
    """Compile one prefill_vec.cpp (kvs_common.h from this tree) and bind it."""
    lib = out_dir / f"{name}.so"
    cmd = ["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
    subprocess.run([*cmd, f"-I{CSRC}", "-o", str(lib), str(src)], check=True)
    return PrefillVec(ctypes.CDLL(str(lib)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--lens", default="512,2048,4096")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        ka = build(args.a, Path(tmp), "a")
        kb = build(args.b, Path(tmp), "b")
        for n in (int(x) for x in args.lens.split(",")):
            gen = torch.Generator().manual_seed(n)
            nblk = -(-n // BS)
            kv = torch.randn(2, HK, nblk + 1, BS, D, generator=gen).to(dtype)
            table = (torch.randperm(nblk, generator=gen) + 1).unsqueeze(0).contiguous()
            q = torch.randn(n, HK * G, D, generator=gen).to(dtype)
            seqs = torch.tensor([[0, n, n, 0, 0]])
            outs = {"a": torch.empty_like(q), "b": torch.empty_like(q)}
            times: dict[str, list[float]] = {"a": [], "b": []}
            reps = max(1, 8192 // n)
            for r in range(args.rounds + 1):
                for name, k in (("a", ka), ("b", kb)) if r % 2 == 0 else (("b", kb), ("a", ka)):
                    t = clock()
                    for _ in range(reps):
                        k.invariant(q, kv, seqs, table, 512, D**-0.5, outs[name])
                    if r:
                        times[name].append((clock() - t) / reps * 1000)
            same = torch.equal(
                outs["a"].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                outs["b"].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            )
            ma, mb = statistics.median(times["a"]), statistics.median(times["b"])
            print(
                f"n={n:5d} a {ma:8.2f} ms  b {mb:8.2f} ms  b/a {mb / ma:.3f}  "
                f"min a {min(times['a']):.2f} b {min(times['b']):.2f}  bitwise-equal {same}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
