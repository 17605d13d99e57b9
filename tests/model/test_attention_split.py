"""Decode attention with a request's key parts split across threads (``run_all`` in
``csrc/paged_attention.cpp``): exact, and bitwise the same as one thread's walk."""

from __future__ import annotations

import random

import pytest
import torch


def _kernel():  # type: ignore[no-untyped-def]
    from kvserve.model.kernels.backend import default_backend

    k = default_backend().attention
    if k is None:
        pytest.skip("no native kernels here")
    return k


def _reference(q, kv, tables, ctx, bs):  # type: ignore[no-untyped-def]
    """fp64 softmax attention of one decode row over its first ctx keys."""
    pos = torch.arange(ctx)
    slots = tables[pos // bs] * bs + pos % bs
    k = kv[0].flatten(1, 2)[:, slots].double()  # [Hk, ctx, D]
    v = kv[1].flatten(1, 2)[:, slots].double()
    g = q.shape[0] // k.shape[0]
    qd = q.double().view(k.shape[0], g, -1)
    p = torch.softmax(qd @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
    return (p @ v).reshape(q.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_parts_are_bitwise_one_walk_and_exact(dtype: torch.dtype) -> None:
    kernel = _kernel()
    gen = torch.Generator().manual_seed(3)
    bs, d, rows = 16, 64, 4
    ctxs = [2100, 1500, 700, 513]  # 5, 3, 2 and 2 parts of 512 keys
    per = -(-max(ctxs) // bs)
    nb = 1 + rows * per
    kv = torch.randn(2, 3, nb, bs, d, generator=gen).to(dtype)
    free = list(range(1, nb))
    random.Random(3).shuffle(free)
    tables = torch.tensor([[free.pop() for _ in range(per)] for _ in range(rows)])
    seqs = torch.tensor([[i, 1, 1, c - 1, 0] for i, c in enumerate(ctxs)])
    q = torch.randn(rows, 9, d, generator=gen).to(dtype)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch_one_thread = kernel(q, kv, seqs, tables, 512, d**-0.5)
        torch.set_num_threads(2)  # one request: 3 tasks for 2 threads, parts split
        for i in range(rows):
            one = torch.tensor([[0, 1, 1, ctxs[i] - 1, 0]])  # the row as a batch of one
            alone = kernel(q[i : i + 1], kv, one, tables[i : i + 1], 512, d**-0.5)
            assert torch.equal(alone[0], batch_one_thread[i]), f"row {i}"
            ref = _reference(q[i], kv, tables[i], ctxs[i], bs)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(alone[0].double(), ref, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(old)
