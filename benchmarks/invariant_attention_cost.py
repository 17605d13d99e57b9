"""Attention-only cost of batch invariance (docs/determinism.md): one layer's prefill
attention of SmolLM2-135M's shape (3 KV heads x 3 query heads, head_dim 64, bfloat16),
one thread, CPU time (robust on a shared machine), for an n-token prompt:

- ``vec``: the fast prefill kernel (csrc/prefill_vec.cpp), what ``--no-batch-invariant`` runs;
- ``split512``: the default mode, rows below 512 in the paged kernel's decode form and
  the rest on the vector kernel;
- ``paged``: every row in the paged kernel (``--batch-invariant`` before the invariant
  prefill kernel);
- ``inv``: every row on ``kvs_prefill_attention_inv`` (the paged kernel's arithmetic,
  rows in lanes): what the default (up to 4,096 tokens) and ``--batch-invariant`` run now.

    PYTHONPATH=. python benchmarks/invariant_attention_cost.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvserve.model.attention_metadata import AUTO_INVARIANT_MAX_CONTEXT
from kvserve.model.kernels.backend import default_backend
from kvserve.model.kernels.paged_attention import PagedAttention
from kvserve.model.kernels.prefill_vec import PrefillVec

BS, HK, G, D = 16, 3, 3, 64


def _seq(row: int, n: int, cached: int) -> torch.Tensor:
    return torch.tensor([[row, n, n, cached, 0]])


def measure(
    kernel: PagedAttention, vec_kernel: PrefillVec, n: int, dtype: torch.dtype = torch.bfloat16
) -> dict[str, float]:
    """Best of 2 x 2 calls per variant, ms of CPU time per call."""
    kv = torch.randn(2, HK, n // BS + 1, BS, D).to(dtype)
    table = (torch.arange(n // BS) + 1).unsqueeze(0).contiguous()
    q = torch.randn(n, HK * G, D).to(dtype)
    out = torch.empty_like(q)
    h = min(n, AUTO_INVARIANT_MAX_CONTEXT)
    scale = D**-0.5

    def vec() -> None:
        vec_kernel(q, kv, _seq(0, n, 0), table, scale, out)

    def split() -> None:
        kernel(q, kv, _seq(0, h, 0), table, 512, scale)
        if n > h:
            vec_kernel(q, kv, _seq(h, n - h, h), table, scale, out)

    def paged() -> None:
        kernel(q, kv, _seq(0, n, 0), table, 512, scale)

    def inv() -> None:
        vec_kernel.invariant(q, kv, _seq(0, n, 0), table, 512, scale, out)

    variants: list[tuple[str, Callable[[], None]]] = [
        ("vec", vec),
        (f"split{h}", split),
        ("paged", paged),
        ("inv", inv),
    ]
    res: dict[str, list[float]] = {}
    for name, f in variants * 2:  # interleaved
        f()
        t = time.process_time()
        for _ in range(2):
            f()
        res.setdefault(name, []).append((time.process_time() - t) / 2 * 1000)
    return {k: round(min(v), 2) for k, v in res.items()}


def main() -> int:
    backend = default_backend()
    kernel, vec_kernel = backend.attention, backend.prefill_vec
    if kernel is None or vec_kernel is None or not vec_kernel.supports(torch.bfloat16, D):
        print("needs the native kernels with the vector prefill kernel")
        return 1
    torch.set_num_threads(1)
    for dtype in (torch.bfloat16, torch.float32):
        for n in (512, 1024, 2048):
            print(dtype, n, "tokens:", measure(kernel, vec_kernel, n, dtype), "ms per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
