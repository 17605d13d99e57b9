"""What the default mode gives up within its reach: cascade attention for decode rows
that share a prefix (docs/determinism.md). One layer of decode attention of
SmolLM2-135M's shape (3 KV heads x 3 query heads, head_dim 64, bfloat16), ``B`` rows
that share a ``P``-token prefix and have ``S`` tokens of their own, one thread, CPU
time, best of interleaved runs:

- ``cascade``: the suffixes on the paged kernel, the shared prefix once for the group
  on the vector prefill kernel, merged (what rows past the reach get);
- ``whole``: every row's whole context on the paged kernel (rows within the reach).

    PYTHONPATH=. python benchmarks/invariant_cascade_cost.py
"""

from __future__ import annotations

import time

import torch

from kvserve.model.kernels.backend import default_backend

BS, HK, G, D = 16, 3, 3, 64


def measure(b: int, prefix: int, own: int) -> dict[str, float]:
    backend = default_backend()
    paged, vec = backend.attention, backend.prefill_vec
    assert paged is not None and vec is not None
    pb, ob = prefix // BS, -(-(own + 1) // BS)
    nblk = pb + b * ob
    kv = torch.randn(2, HK, nblk + 1, BS, D).to(torch.bfloat16)
    q = torch.randn(b, HK * G, D).to(torch.bfloat16)
    shared = torch.arange(pb) + 1
    tables = torch.stack(
        [torch.cat([shared, pb + 1 + i * ob + torch.arange(ob)]) for i in range(b)]
    ).contiguous()
    whole_seqs = torch.tensor([[i, 1, 1, prefix + own, 0] for i in range(b)])
    suffix_seqs = torch.tensor([[i, 1, 1, own, 0] for i in range(b)])
    suffix_tables = tables[:, pb:].contiguous()
    group_seqs = torch.tensor([[0, b, b, prefix, 1]])
    group_tables = shared.unsqueeze(0).contiguous()
    row_map = torch.arange(b)
    scale = D**-0.5

    def cascade() -> None:
        lse = torch.full(q.shape[:2], float("-inf"))
        out = paged(q, kv, suffix_seqs, suffix_tables, 512, scale, lse=lse)
        vec(q, kv, group_seqs, group_tables, scale, out, lse, row_map, merge=True)

    def whole() -> None:
        paged(q, kv, whole_seqs, tables, 512, scale)

    res: dict[str, list[float]] = {}
    for name, f in [("cascade", cascade), ("whole", whole)] * 3:
        f()
        t = time.process_time()
        for _ in range(3):
            f()
        res.setdefault(name, []).append((time.process_time() - t) / 3 * 1000)
    return {k: round(min(v), 3) for k, v in res.items()}


def main() -> int:
    torch.set_num_threads(1)
    for b, prefix, own in ((16, 1024, 64), (16, 256, 64), (32, 1024, 64), (8, 2048, 128)):
        print(f"B={b} prefix={prefix} own={own}:", measure(b, prefix, own), "ms per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
