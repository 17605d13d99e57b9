"""The fused native layer ops against PyTorch references, and the whole native forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.prefill import chunked_prefill_logits

from kvserve.model.kernels.backend import default_backend

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def nk():
    kernel = default_backend().norms
    assert kernel is not None, "the test machine has a C++ compiler"
    return kernel


@pytest.fixture(scope="module")
def lk():
    kernel = default_backend().linear
    assert kernel is not None, "the test machine has a C++ compiler"
    return kernel


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm(nk, dtype: torch.dtype, with_x: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    residual = torch.randn(7, 96, generator=gen) * 3
    x = (torch.randn(7, 200, generator=gen) * 2).to(dtype)[:, :96]  # strided rows
    w = torch.randn(96, generator=gen).to(dtype)
    expect_res = residual + x.float() if with_x else residual.clone()
    expect = F.rms_norm(expect_res, (96,), w.float(), 1e-5).to(dtype)
    got = nk.add_rms_norm(residual, x if with_x else None, w, 1e-5)
    torch.testing.assert_close(residual, expect_res, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.float(), expect.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 64])  # a vector tail and none
def test_silu_mul(nk, dtype: torch.dtype, inter: int) -> None:
    gu = (torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)
    gate, up = gu.float().chunk(2, -1)
    expect = (F.silu(gate) * up).to(dtype)
    torch.testing.assert_close(nk.silu_mul(gu).float(), expect.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_rms_norm(nk, dtype: torch.dtype) -> None:
    """Qwen3's per-head q/k RMSNorm in place on the first heads of each (strided) row,
    as transformers computes it; the V heads and the rest of the row untouched."""
    gen = torch.Generator().manual_seed(2)
    heads, d, eps = 6, 32, 1e-6
    buf = (torch.randn(5, 300, generator=gen) * 4).to(dtype)
    qkv = buf[:, : (heads + 2) * d]  # 2 more heads (V) after the normed ones; row stride 300
    w = (torch.rand(heads, d, generator=gen) + 0.5).to(dtype)
    before = buf.clone()
    x = qkv[:, : heads * d].reshape(5, heads, d).float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    expect = (w * normed).reshape(5, heads * d)
    nk.head_rms_norm(qkv, heads, d, w, eps)
    torch.testing.assert_close(qkv[:, : heads * d].float(), expect.float(), **_tol(dtype))
    assert torch.equal(buf[:, heads * d :], before[:, heads * d :])
    with pytest.raises(ValueError, match="contiguous"):
        nk.head_rms_norm(qkv, heads, d, w.t(), eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache(nk, dtype: torch.dtype) -> None:
    h, hk, d, bs, blocks = 4, 2, 16, 4, 6
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, (h + 2 * hk) * d, generator=gen).to(dtype)
    positions = torch.tensor([3, 9, 0, 17, 5])
    slots = torch.tensor([4, 7, -1, 13, 22])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(32).float(), inv)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    kv = torch.zeros(2, hk, blocks, bs, d, dtype=dtype)
    # reference: HF's rotate-half RoPE in fp32
    x = qkv.float().view(5, h + 2 * hk, d)
    c = torch.cat([cos[positions], cos[positions]], -1)[:, None]
    s = torch.cat([sin[positions], sin[positions]], -1)[:, None]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    qk_ref = (x * c + rot * s)[:, : h + hk]
    before = qkv.clone()
    nk.rope_and_cache(qkv, h, hk, d, positions, cos, sin, kv, slots)
    got = qkv.float().view(5, h + 2 * hk, d)
    torch.testing.assert_close(got[:, : h + hk], qk_ref, **_tol(dtype))
    assert torch.equal(qkv.view(5, -1, d)[:, h + hk :], before.view(5, -1, d)[:, h + hk :])
    flat = kv.view(2, hk, -1, d)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(flat[0, :, slot], qkv.view(5, -1, d)[t, h : h + hk])
        assert torch.equal(flat[1, :, slot], qkv.view(5, -1, d)[t, h + hk :])
    written = (flat != 0).any(-1).any(0).any(0)
    assert written.sum() == 4, "the padding row (slot -1) writes nothing"


def test_native_forward_matches_portable(loaded_model) -> None:
    """Fused native layers (fp32 residual) and the portable layers give the same logits."""
    model = loaded_model.model
    assert model.uses_native_layers
    ids = loaded_model.tokenizer("The quick brown fox jumps over the lazy dog. " * 6)["input_ids"]
    logits = {
        backend: chunked_prefill_logits(  # chunked: later chunks read the pages
            model, ids, chunk=24, backend=backend, kv_segment_size=32, hidden_dtype=torch.float32
        )
        for backend in ("native", "portable")
    }
    torch.testing.assert_close(logits["native"], logits["portable"], atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (1, 960, 576),
        (2, 70, 37),
        (8, 64, 16),
        (13, 100, 48),
        (16, 3072, 64),
        (33, 40, 9),
        (0, 32, 8),
    ],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_f32_matches_float64(lk, rows: int, n: int, k: int, with_bias: bool) -> None:
    """The panel kernel: every row block size (1-8 and more), N not a multiple of 32
    (masked last panel), strided input rows, optional bias."""
    if not lk.linear_f32_available:
        pytest.skip("build without AVX-512")
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(rows, k + 5, generator=gen)[:, :k]  # strided rows
    panels = lk.pack_linear_f32(w)
    assert panels.shape == (-(-n // 32), k, 32)
    got = lk.linear_f32(x, panels, n, bias)
    expect = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got.shape == (rows, n)
    torch.testing.assert_close(got.double(), expect, atol=1e-4, rtol=1e-5)


def test_fast_linear_routes_float32_decode_rows_to_the_panel_kernel(lk, monkeypatch) -> None:
    """float32 FastLinear uses the panel kernel up to NATIVE_F32_MAX_M rows and the
    prepacked GEMM above; both agree with F.linear."""
    import kvserve.model.linear as lin_mod

    if not lk.linear_f32_available:
        pytest.skip("build without AVX-512")
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    lin = lin_mod.FastLinear(w, b, fast=True, pack=lin_mod.mkldnn_linear_works(w.dtype), native=lk)
    assert lin.panels is not None and lin.wt is None
    calls: list[int] = []
    real = lk.linear_f32
    monkeypatch.setattr(lk, "linear_f32", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    for rows in (1, lin_mod.NATIVE_F32_MAX_M, lin_mod.NATIVE_F32_MAX_M + 1, 200):
        x = torch.randn(rows, 40, generator=gen)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    assert calls == [1, lin_mod.NATIVE_F32_MAX_M]


def _check_bf16_panels(lk, linear, rows: int, n: int, k: int, with_bias: bool, seed: int) -> None:  # type: ignore[no-untyped-def]
    """``linear(x, panels, n, bias)`` (a bfloat16 panel kernel) on random bf16 weights
    packed by ``pack_linear_bf16``, strided rows and an optional bias padded to the
    panels: bf16 [rows, n] within one bf16 rounding of the float64 result."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(rows, k + 6, generator=gen).bfloat16()[:, :k]
    panels = lk.pack_linear_bf16(w)
    assert panels.shape == (-(-n // 32), k // 2, 32, 2)
    padded = None
    if bias is not None:
        padded = torch.zeros(panels.shape[0] * 32)
        padded[:n] = bias
    got = linear(x, panels, n, padded)
    expect = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), expect, atol=1e-3, rtol=8e-3)


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 960, 576), (3, 70, 38), (8, 64, 16), (11, 40, 8)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_bf16_matches_float32(lk, rows: int, n: int, k: int, with_bias: bool) -> None:
    """The bfloat16 panel kernel: fp32 sums of bf16 products, rounded once to bf16
    (so within one bf16 rounding of the fp32 result); masked last panel, strided rows."""
    if not lk.linear_bf16_available:
        pytest.skip("build without AVX512-BF16")
    _check_bf16_panels(lk, lk.linear_bf16, rows, n, k, with_bias, seed=rows * 7 + n + k)


@pytest.mark.parametrize(
    ("rows", "n", "k"), [(5, 960, 576), (16, 70, 64), (17, 40, 32), (32, 100, 96), (70, 33, 64)]
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_bf16_amx_matches_float32(lk, rows: int, n: int, k: int, with_bias: bool) -> None:
    """The AMX panel kernel: one and two row tiles, partial tiles, more than 32 rows
    (a second pass over each panel), masked last panel, strided rows, optional bias --
    within one bf16 rounding of the fp32 result, like the vector panel kernel."""
    if not lk.linear_bf16_amx_available:
        pytest.skip("no AMX-BF16 here")
    _check_bf16_panels(lk, lk.linear_bf16_amx, rows, n, k, with_bias, seed=rows * 11 + n + k)


def test_linear_bf16_amx_rejects_k_not_a_multiple_of_32(lk) -> None:
    if not lk.linear_bf16_amx_available:
        pytest.skip("no AMX-BF16 here")
    w = torch.randn(40, 48).bfloat16()
    with pytest.raises(RuntimeError, match="returned 2"):
        lk.linear_bf16_amx(torch.randn(8, 48).bfloat16(), lk.pack_linear_bf16(w), 40, None)


def test_fast_linear_routes_bfloat16_rows_to_the_panel_kernels(lk, monkeypatch) -> None:
    """bfloat16 FastLinear keeps only its panels (no dense weight, no oneDNN copy) and
    runs them at every M: the vector panel kernel up to NATIVE_BF16_MAX_M rows, then the
    AMX panel kernel (K a multiple of 32 and AMX here) or the vector one; every route
    agrees with F.linear, and dense()/rows() give back the packed values bitwise."""
    import kvserve.model.linear as lin_mod

    if not lk.linear_bf16_available:
        pytest.skip("build without AVX512-BF16")
    gen = torch.Generator().manual_seed(6)
    w, b = torch.randn(96, 64, generator=gen).bfloat16(), torch.randn(96, generator=gen).bfloat16()
    pack = lin_mod.mkldnn_linear_works(torch.bfloat16)
    lin = lin_mod.FastLinear(w, b, fast=True, pack=pack, native=lk)
    assert lin.panels is not None and lin.panels.dtype == torch.bfloat16
    assert lin.weight is None and lin.packed is None and lin.wt is None
    assert torch.equal(lin.dense(), w)
    ids = torch.tensor([0, 95, 33, 31, 32, 7])
    assert torch.equal(lin.rows(ids), w[ids])
    assert lin.amx == lk.linear_bf16_amx_available
    calls: list[tuple[str, int]] = []
    for name in ("linear_bf16", "linear_bf16_amx"):
        real = getattr(lk, name)
        monkeypatch.setattr(
            lk,
            name,
            lambda x, *a, name=name, real=real: calls.append((name, x.shape[0])) or real(x, *a),
        )
    small = lin_mod.NATIVE_BF16_MAX_M
    sizes = (1, small, small + 1, 32, 33, 64, 200)
    for rows in sizes:
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        expect = F.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(lin(x).float(), expect, atol=3e-2, rtol=2e-2)
    big = "linear_bf16_amx" if lk.linear_bf16_amx_available else "linear_bf16"
    assert calls == [("linear_bf16", 1), ("linear_bf16", small)] + [
        (big, rows) for rows in sizes[2:]
    ]
    # an input size that is not a multiple of 32 never goes to the AMX kernel
    odd = lin_mod.FastLinear(w[:, :40].contiguous(), None, fast=True, pack=pack, native=lk)
    assert not odd.amx
