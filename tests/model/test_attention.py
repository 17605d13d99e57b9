"""Paged attention (segmented prefill, batched decode) against a plain reference."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model import attention_metadata as am
from kvserve.model.attention import (
    SeqSpec,
    build_attention_metadata,
    merge_attention_states,
    paged_attention,
    segment_bounds,
)


def reference_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, spec: SeqSpec, block_size: int, scale: float
) -> torch.Tensor:
    """Gather every KV of the request from its blocks; full causal softmax. -> [n, H, D]."""
    n, c = spec.num_tokens, spec.cached_seq_len
    pos = torch.arange(c + n)
    bt = torch.tensor(list(spec.block_ids), dtype=torch.long)
    slots = bt[pos // block_size] * block_size + pos % block_size
    flat = kv_cache.view(2, kv_cache.shape[1], -1, kv_cache.shape[-1]).double()
    k, v = flat[0][:, slots].transpose(0, 1), flat[1][:, slots].transpose(0, 1)  # [c + n, Hk, D]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, c + n, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    qh = q[spec.token_start : spec.token_start + n].double().transpose(0, 1)  # [H, n, D]
    scores = qh @ k.transpose(1, 2) * scale  # [H, n, c + n]
    q_pos = torch.arange(c, c + n)[:, None]
    scores = scores.masked_fill(pos[None, :] > q_pos, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).float()


def random_step(
    case: dict, dtype: torch.dtype
) -> tuple[list[SeqSpec], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_make_step`'s specs and cache, and random q, k, v for it, all in ``dtype``:
    (specs, q, k, v, kv_cache)."""
    specs, num_tokens, kv_cache = _make_step(case)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    h, hk, d = case["num_heads"], case["num_kv_heads"], case["head_dim"]
    q, k, v = (torch.randn(num_tokens, n, d, generator=gen).to(dtype) for n in (h, hk, hk))
    return specs, q, k, v, kv_cache.to(dtype)


def native_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    specs: list[SeqSpec],
    case: dict,
    scale: float,
) -> torch.Tensor:
    """``paged_attention`` of one step on the native backend, with the metadata of the
    case's block size, segment size and dummy decode rows (K/V in q's dtype)."""
    meta = build_attention_metadata(
        specs,
        num_tokens=q.shape[0],
        num_dummy_decode_rows=case["num_dummy"],
        block_size=case["block_size"],
        kv_segment_size=case["kv_segment_size"],
        backend="native",
        kv_dtype=q.dtype,
    )
    return paged_attention(q, k, v, kv_cache, meta, scale)


def check_rows(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    specs: list[SeqSpec],
    block_size: int,
    scale: float,
    tol: float,
) -> None:
    """Each request's real rows of ``out`` match :func:`reference_attention` (atol and
    rtol ``tol``)."""
    for s in specs:
        ref = reference_attention(q.float(), kv_cache.float(), s, block_size, scale)
        got = out[s.token_start : s.token_start + s.num_tokens].float()
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def spy_calls(mp: pytest.MonkeyPatch, kernel: object, record: Callable[..., Any]) -> list[Any]:
    """Patch ``kernel``'s class so that each call appends ``record(*args, **kwargs)``
    (args after self) to the returned list, then runs the kernel."""
    calls: list[Any] = []
    original = type(kernel).__call__  # type: ignore[operator]

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(record(*args, **kwargs))
        return original(self, *args, **kwargs)

    mp.setattr(type(kernel), "__call__", spy)
    return calls


def seqs_and_merge(*args: Any, **kwargs: Any) -> tuple[int, bool]:
    """A prefill kernel call's record for :func:`spy_calls`: (number of seqs, merge)."""
    return args[2].shape[0], bool(kwargs.get("merge"))


@st.composite
def batches(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([16, 32, 128]))
    kv_segment_size = draw(st.sampled_from([0, 8, 16, 24, 32, 64, 512]))
    num_kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.sampled_from([8, 16, 64]))
    prefills = draw(
        st.lists(
            st.tuples(
                st.integers(0, 300),  # cached_seq_len: any value, not only block multiples
                st.integers(1, 40),  # real tokens
                st.integers(0, 6),  # padding rows
            ),
            max_size=3,
        )
    )
    decodes = draw(st.lists(st.integers(0, 400), max_size=5))  # cached_seq_len per decode row
    num_dummy = draw(st.integers(0, 3))
    if not prefills and not decodes and not num_dummy:
        decodes = [draw(st.integers(0, 50))]
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(
        block_size=block_size,
        kv_segment_size=kv_segment_size,
        num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * group,
        head_dim=head_dim,
        prefills=prefills,
        decodes=decodes,
        num_dummy=num_dummy,
        seed=seed,
    )


def _make_step(case: dict) -> tuple[list[SeqSpec], int, torch.Tensor]:
    """Specs in flat order with disjoint random blocks, and a random-filled cache."""
    rng = random.Random(case["seed"])
    bs = case["block_size"]
    lengths = [(c, n, n + p) for c, n, p in case["prefills"]]
    # a prefill needs >= 2 rows (one-row requests are decode rows)
    lengths = [(c, n, max(rows, 2)) for c, n, rows in lengths]
    lengths += [(c, 1, 1) for c in case["decodes"]]
    need = [-(-(c + n) // bs) for c, n, _ in lengths]
    num_blocks = 1 + sum(need) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    specs, row = [], 0
    for (c, n, rows), nb in zip(lengths, need, strict=True):
        blocks = [free.pop() for _ in range(nb)]
        specs.append(SeqSpec(row, rows, n, c, blocks))
        row += rows
    gen = torch.Generator().manual_seed(case["seed"])
    kv_cache = torch.randn(2, case["num_kv_heads"], num_blocks, bs, case["head_dim"], generator=gen)
    return specs, row + case["num_dummy"], kv_cache


@pytest.mark.parametrize("backend", ["native", "native-split", "portable"])
@settings(max_examples=60, deadline=None)
@given(case=batches())
def test_paged_attention_matches_reference(case: dict, backend: str) -> None:
    """Both implementations against the gather-all reference, over random batches.

    "native" runs float32 prefills of up to 20 new tokens or 200 of context whole in
    the kernel (both limits lowered from their defaults so that hypothesis draws
    both kinds); "native-split" sets both limits to 0, so
    every causal part goes through flash and merges with the kernel's prior part.
    """
    split = backend == "native-split"
    backend = backend.removesuffix("-split")
    with (
        mock.patch.object(am, "NATIVE_WHOLE_MAX_CONTEXT", 0 if split else 200),
        mock.patch.object(am, "NATIVE_WHOLE_MAX_TOKENS", 0 if split else 20),
    ):
        _check_against_reference(case, backend)


def _check_against_reference(case: dict, backend: str) -> None:
    specs, num_tokens, kv_cache = _make_step(case)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    h, hk, d = case["num_heads"], case["num_kv_heads"], case["head_dim"]
    q = torch.randn(num_tokens, h, d, generator=gen)
    k = torch.randn(num_tokens, hk, d, generator=gen)
    v = torch.randn(num_tokens, hk, d, generator=gen)
    scale = d**-0.5
    meta = build_attention_metadata(
        specs,
        num_tokens=num_tokens,
        num_dummy_decode_rows=case["num_dummy"],
        block_size=case["block_size"],
        kv_segment_size=case["kv_segment_size"],
        backend=backend,  # type: ignore[arg-type]
    )
    assert (meta.native is not None) == (backend == "native")
    if meta.native is not None:
        whole = [p.whole for p in meta.native.prefills]
        assert whole == [
            n <= am.NATIVE_WHOLE_MAX_TOKENS or c + n <= am.NATIVE_WHOLE_MAX_CONTEXT
            for c, n, _ in case["prefills"]
        ]
    before = kv_cache.clone()
    out = paged_attention(q, k, v, kv_cache, meta, scale)
    assert out.shape == (num_tokens, h, d)
    assert torch.isfinite(out).all()

    # KV writes: exactly the real tokens' slots changed, to their new K/V
    flat_before = before.view(2, hk, -1, d).transpose(1, 2)  # [2, slots, Hk, D]
    flat_after = kv_cache.view(2, hk, -1, d).transpose(1, 2)
    changed = (flat_before != flat_after).flatten(2).any(-1).any(0)  # [slots]
    written = torch.zeros_like(changed)
    for s in specs:
        slots = meta.slot_mapping[s.token_start : s.token_start + s.num_tokens]
        assert (slots >= 0).all()
        written[slots] = True
        rows = slice(s.token_start, s.token_start + s.num_tokens)
        assert torch.equal(flat_after[0, slots], k[rows])
        assert torch.equal(flat_after[1, slots], v[rows])
        pad = meta.slot_mapping[s.token_start + s.num_tokens : s.token_start + s.num_rows]
        assert (pad == -1).all()
    assert (meta.slot_mapping[num_tokens - case["num_dummy"] :] == -1).all()
    assert not (changed & ~written).any(), "padding or dummy rows wrote the KV cache"

    for s in specs:
        ref = reference_attention(q, kv_cache, s, case["block_size"], scale)
        got = out[s.token_start : s.token_start + s.num_tokens]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_segment_bounds_partial_last_segment() -> None:
    assert segment_bounds(0, 512) == []
    assert segment_bounds(3584, 1024) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 3584)]
    assert segment_bounds(2048, 1024) == [(0, 1024), (1024, 2048)]
    assert segment_bounds(700, 0) == [(0, 700)]


def test_merge_attention_states_is_exact() -> None:
    """Splitting keys in two parts and merging equals attention over all keys."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 8, generator=gen)
    k = torch.randn(2, 12, 8, generator=gen)
    v = torch.randn(2, 12, 8, generator=gen)

    def part(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = q @ k[:, lo:hi].transpose(1, 2)
        lse = torch.logsumexp(s, -1)
        return torch.softmax(s, -1) @ v[:, lo:hi], lse

    o1, l1 = part(0, 7)
    o2, l2 = part(7, 12)
    o, lse = merge_attention_states(o1, l1, o2, l2)
    ref, ref_lse = part(0, 12)
    torch.testing.assert_close(o, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ["native", "portable"])
def test_metadata_rejects_prefill_after_decode(backend: str) -> None:
    specs = [SeqSpec(0, 1, 1, 3, [1]), SeqSpec(1, 4, 4, 0, [2])]
    with pytest.raises(ValueError, match="before one-row"):
        build_attention_metadata(
            specs,
            num_tokens=5,
            block_size=16,
            kv_segment_size=16,
            backend=backend,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("causal", [True, False])
def test_portable_attention_matches_cpu_kernel(causal: bool) -> None:
    """The non-CPU fallback (used on other devices) agrees with the fused CPU kernel."""
    from kvserve.model.attention import _attention_lse_math, attention_with_lse

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 9, 16, generator=gen)
    k = torch.randn(2, 2, 9, 16, generator=gen)  # GQA: 3 query heads per KV head
    v = torch.randn(2, 2, 9, 16, generator=gen)
    mask = torch.zeros(2, 1, 1, 9)
    mask[1, ..., 7:] = float("-inf")
    fused = attention_with_lse(q, k, v, causal=causal, scale=0.25, attn_mask=mask)
    portable = _attention_lse_math(q, k, v, causal, mask, 0.25)
    torch.testing.assert_close(portable[0], fused[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(portable[1], fused[1], atol=1e-5, rtol=0)


@settings(max_examples=25, deadline=None)
@given(case=batches())
def test_native_bfloat16_matches_float64_reference(case: dict) -> None:
    """bf16 K/V and queries: the kernel accumulates in fp32, so only input rounding shows."""
    specs, q, k, v, kv_cache = random_step(case, torch.bfloat16)
    d = case["head_dim"]
    out = native_step(q, k, v, kv_cache, specs, case, d**-0.5)
    assert out.dtype == torch.bfloat16
    check_rows(out, q, kv_cache, specs, case["block_size"], d**-0.5, 2e-2)
    assert torch.isfinite(out.float()).all(), "padding and dummy rows stay finite"


def test_native_reads_pages_in_place_with_strided_queries() -> None:
    """q may be a strided view (the model passes a slice of the fused q/k tensor)."""
    gen = torch.Generator().manual_seed(7)
    kv_cache = torch.randn(2, 2, 6, 16, 8, generator=gen)
    qk = torch.randn(3, 6, 8, generator=gen)  # [T, H + Hk, D]: q is qk[:, :4]
    specs = [SeqSpec(0, 2, 2, 20, [3, 5]), SeqSpec(2, 1, 1, 9, [1])]
    outs = []
    for backend in ("native", "portable"):
        cache = kv_cache.clone()
        meta = build_attention_metadata(
            specs, num_tokens=3, block_size=16, kv_segment_size=8, backend=backend
        )
        outs.append(paged_attention(qk[:, :4], qk[:, 4:], qk[:, 4:], cache, meta, 0.3))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_portable_env_disables_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVSERVE_ATTENTION=portable turns native attention off and nothing else."""
    from kvserve.model.kernels.backend import default_backend

    assert default_backend().attention is not None, "the test machine has a C++ compiler"
    monkeypatch.setenv("KVSERVE_ATTENTION", "portable")
    backend = default_backend()
    assert backend.attention is None and backend.prefill_vec is None
    assert backend.sampling is not None and backend.norms is not None
    assert backend.linear is not None
    meta = build_attention_metadata(
        [SeqSpec(0, 1, 1, 0, [1])], num_tokens=1, block_size=16, kv_segment_size=0
    )
    assert meta.native is None and meta.decode is not None
    with pytest.raises(RuntimeError, match="unavailable"):
        build_attention_metadata(
            [SeqSpec(0, 1, 1, 0, [1])],
            num_tokens=1,
            block_size=16,
            kv_segment_size=0,
            backend="native",
        )


def test_bad_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend"):
        build_attention_metadata(
            [SeqSpec(0, 1, 1, 0, [1])],
            num_tokens=1,
            block_size=16,
            kv_segment_size=0,
            backend="fast",  # type: ignore[arg-type]
        )
