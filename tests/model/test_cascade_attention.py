"""Cascade (shared-prefix) decode attention on the vector kernel, against a reference."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model.test_attention import check_rows, native_step, spy_calls

from kvserve.model.attention import SeqSpec
from kvserve.model.kernels.backend import default_backend
from kvserve.model.kernels.prefill_amx import AMX_ENV_VAR
from kvserve.model.kernels.prefill_vec import VEC_ENV_VAR


@st.composite
def shared_prefix_steps(draw: st.DrawFn) -> dict:
    """Decode rows in groups sharing leading blocks, beside unrelated rows and prefills."""
    return dict(
        block_size=draw(st.sampled_from([16, 32])),
        kv_segment_size=draw(st.sampled_from([0, 64, 512])),
        groups=draw(
            st.lists(
                st.tuples(
                    st.integers(1, 40),  # shared blocks
                    st.lists(st.integers(0, 90), min_size=1, max_size=5),  # own suffix tokens
                ),
                min_size=1,
                max_size=3,
            )
        ),
        loners=draw(st.lists(st.integers(0, 300), max_size=3)),
        prefill=draw(st.one_of(st.none(), st.tuples(st.integers(0, 200), st.integers(2, 70)))),
        num_dummy=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _shared_prefix_specs(case: dict) -> tuple[list[SeqSpec], int, torch.Tensor, int]:
    """Specs (prefill first, then decode rows) whose groups share their first blocks."""
    rng = random.Random(case["seed"])
    bs = case["block_size"]
    next_block = [1]

    def fresh(n: int) -> list[int]:
        out = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        return out

    specs: list[SeqSpec] = []
    row = 0
    if case["prefill"] is not None:
        cached, n = case["prefill"]
        specs.append(SeqSpec(0, n, n, cached, fresh(-(-(cached + n) // bs))))
        row = n
    decodes: list[tuple[int, list[int]]] = []
    num_groups = 0
    for shared_blocks, suffixes in case["groups"]:
        shared = fresh(shared_blocks)
        num_groups += len(suffixes) > 1 and shared_blocks * bs >= 64
        for extra in suffixes:
            cached = shared_blocks * bs + extra  # the own token sits after the suffix
            decodes.append((cached, shared + fresh(-(-(cached + 1) // bs) - shared_blocks)))
    for cached in case["loners"]:
        decodes.append((cached, fresh(-(-(cached + 1) // bs))))
    rng.shuffle(decodes)  # group members need not be adjacent rows
    for cached, blocks in decodes:
        specs.append(SeqSpec(row, 1, 1, cached, blocks))
        row += 1
    # shuffle physical block ids so that groups are found by id, not by position
    perm = list(range(1, next_block[0]))
    rng.shuffle(perm)
    remap = {b: perm[b - 1] for b in range(1, next_block[0])}
    specs = [
        SeqSpec(
            s.token_start,
            s.num_rows,
            s.num_tokens,
            s.cached_seq_len,
            [remap[b] for b in s.block_ids],
        )
        for s in specs
    ]
    gen = torch.Generator().manual_seed(case["seed"])
    kv_cache = torch.randn(2, 3, next_block[0] + 1, bs, 64, generator=gen).bfloat16()
    return specs, row + case["num_dummy"], kv_cache, num_groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=20, deadline=None)
@given(case=shared_prefix_steps())
def test_vector_cascade_matches_reference(case: dict, dtype: torch.dtype) -> None:
    """Without AMX and the vector prefill kernel (AMX and KVSERVE_PREFILL_VEC off):
    decode-only steps with shared-prefix groups run the group's prefix through the
    decode kernel once, merged into each row (tests/model/test_prefill_vec.py covers
    the prefill kernel's cascade)."""
    kernel = default_backend().attention
    assert kernel is not None
    case = dict(case, prefill=None)
    specs, num_tokens, kv_cache, num_groups = _shared_prefix_specs(case)
    kv_cache = kv_cache.to(dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(AMX_ENV_VAR, "0")
        mp.setenv(VEC_ENV_VAR, "0")
        calls = spy_calls(mp, kernel, lambda *args, **kwargs: kwargs.get("out") is not None)
        gen = torch.Generator().manual_seed(case["seed"] + 1)
        q, k, v = (torch.randn(num_tokens, n, 64, generator=gen).to(dtype) for n in (9, 3, 3))
        out = native_step(q, k, v, kv_cache, specs, case, 0.125)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    check_rows(out, q, kv_cache, specs, case["block_size"], 0.125, tol)
    assert calls.count(True) == (1 if num_groups else 0), "one merged call for all groups"
