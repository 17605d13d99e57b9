"""Quantized linear kernels (csrc/linear_quant.cpp) against the PyTorch reference,
the formats' pack/unpack round trip, and the determinism rule: a row's output is
bitwise the same alone, within 2-32 rows and within a prefill-sized chunk."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.kernels.backend import default_backend
from kvserve.model.quant.formats import (
    FORMATS,
    Q4_0,
    Q4_1,
    Q8_0,
    QuantWeight,
    quantize_4bit,
    quantize_symmetric8,
    reference_linear,
)
from kvserve.model.quant.linear import QuantLinear


def _random_weight(fmt_name: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    gen = torch.Generator().manual_seed(seed)
    fmt = FORMATS[fmt_name]
    u = torch.randint(0, 1 << fmt.bits, (n, k), generator=gen).to(torch.uint8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).to(torch.float16)
    m = (torch.randn(n, k // 32, generator=gen) * 0.05).to(torch.float16) if fmt.has_min else None
    return QuantWeight.pack(u, d, m, fmt)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_pack_unpack_round_trip(fmt: str) -> None:
    w = _random_weight(fmt, 40, 96)  # 40 rows: a padded last panel
    u, d, m = w.unpack()
    again = QuantWeight.pack(u, d, m, w.fmt)
    assert torch.equal(again.data, w.data)
    assert w.nbytes == 3 * 3 * w.fmt.block_bytes


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("path", ["scalar", "avx2", "vnni"])
def test_kernel_matches_reference(kernel, fmt: str, path: str) -> None:  # type: ignore[no-untyped-def]
    if path not in kernel.paths:
        pytest.skip(f"{path} not compiled in here")
    w = _random_weight(fmt, 72, 160, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, 160, generator=gen)
    bias = torch.randn(72, generator=gen)
    got = kernel.linear(x, w, bias, path=path)
    ref = reference_linear(x, w, bias)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # and the reference itself is close to the float product (activation rounding only)
    exact = x @ w.dequantize().T + bias
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()


def test_paths_bitwise_equal(kernel) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    for fmt in sorted(FORMATS):
        w = _random_weight(fmt, 48, 256, seed=4)
        outs = [kernel.linear(x, w, path=p) for p in sorted(kernel.paths)]
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), fmt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_result_independent_of_batch(kernel, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(200, 576, generator=gen).to(dtype)
    for fmt in ("q4_1", "q8_0", "q4_0"):
        w = _random_weight(fmt, 160, 576, seed=6)
        alone = torch.cat([kernel.linear(x[i : i + 1], w) for i in range(33)])
        for m in (2, 3, 7, 8, 9, 16, 17, 31, 32):
            assert torch.equal(kernel.linear(x[:m], w), alone[:m]), (fmt, m)
        chunk = kernel.linear(x, w)  # a prefill chunk: several 64-row passes
        assert torch.equal(chunk[:33], alone)
        assert torch.equal(kernel.linear(x[100:165], w)[0], chunk[100]), fmt


def test_bf16_output_and_strided_out(kernel) -> None:  # type: ignore[no-untyped-def]
    w1, w2 = _random_weight("q4_1", 32, 64, 7), _random_weight("q8_0", 16, 64, 8)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    lin = QuantLinear([w1, w2], None, kernel)
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 48)
    ref = torch.cat([reference_linear(x, w1), reference_linear(x, w2)], 1)
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2)
    portable = QuantLinear([w1, w2], None, None)(x)
    torch.testing.assert_close(portable.float(), got.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_embed_matches_dequantize(kernel, fmt: str) -> None:  # type: ignore[no-untyped-def]
    w = _random_weight(fmt, 50, 96, seed=10)
    ids = torch.tensor([0, 49, 17, 17, 3])
    full = w.dequantize()
    assert torch.equal(kernel.embed(w, ids, torch.float32), full[ids])
    assert torch.equal(kernel.embed(w, ids, torch.bfloat16), full[ids].to(torch.bfloat16))


def test_quantizers_reconstruct() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(11)) * 0.05
    for q, tol in (
        (quantize_symmetric8(w), 0.01),
        (quantize_4bit(w, True), 0.12),
        (quantize_4bit(w, False), 0.2),
    ):
        err = (q.dequantize() - w).norm() / w.norm()
        assert err < tol, (q.fmt.name, float(err))
    assert quantize_4bit(w, True).fmt == Q4_1 and quantize_4bit(w, False).fmt == Q4_0
    assert quantize_symmetric8(w).fmt == Q8_0


def test_quant_ops_trace_as_opaque_operators(kernel) -> None:  # type: ignore[no-untyped-def]
    """Compiled graphs (fullgraph) see QuantEmbedding / QuantLinear as single operators."""
    from kvserve.model.quant.linear import QuantEmbedding

    table = _random_weight("q8_0", 64, 96, 12)
    emb = QuantEmbedding([table], torch.float32, kernel)
    lin = QuantLinear([_random_weight("q4_1", 48, 96, 13)], None, kernel)

    def fn(ids: torch.Tensor) -> torch.Tensor:
        return lin(emb(ids)) * 2

    ids = torch.tensor([1, 5, 63])
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(ids), fn(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_quantizer_matches_scalar(kernel, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """The AVX-512 activation quantizer (vnni/avx2 paths) rounds as the scalar one:
    ties to even, an all-zero block, a block with one large value."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(14)) * 3
    x[0, :32] = torch.arange(32) - 15.5  # amax 15.5 -> halves land on exact ties
    x[0, 31] = 127.0  # d_x = 1: x * (1/d_x) = k + 0.5 exactly
    x[1, 32:64] = 0.0
    x[2, 64:96] = 0.0
    x[2, 70] = -1e4
    x = x.to(dtype)
    for fmt in sorted(FORMATS):
        w = _random_weight(fmt, 32, 256, seed=15)
        outs = {p: kernel.linear(x, w, path=p) for p in sorted(kernel.paths)}
        for p, o in outs.items():
            assert torch.equal(o, outs["scalar"]), (fmt, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_is_linear_then_native_silu(kernel, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """kvs_linear_quant_silu_mul gives bitwise what the linear followed by the native
    kvs_silu_mul gives, on every path, alone or in a batch (row independence)."""

    native = default_backend().norms
    assert native is not None
    gen = torch.Generator().manual_seed(16)
    x = (torch.randn(70, 192, generator=gen) * 2).to(dtype)
    bias = torch.randn(96, generator=gen)
    for fmt in ("q4_1", "q8_0"):
        w = _random_weight(fmt, 96, 192, seed=17)  # gate 48 rows (3 panels), up 48
        for b in (None, bias):
            two = native.silu_mul(kernel.linear(x, w, b))
            for path in sorted(kernel.paths):
                fused = kernel.linear_silu_mul(x, w, b, path=path)
                assert fused.shape == (70, 48) and fused.dtype == dtype
                assert torch.equal(fused, two), (fmt, path, b is None)
            alone = torch.cat([kernel.linear_silu_mul(x[i : i + 1], w, b) for i in range(9)])
            assert torch.equal(alone, two[:9])
        lin = QuantLinear([w], None, kernel)
        assert lin.fused_silu_capable
        assert torch.equal(lin.silu_mul(x), native.silu_mul(lin(x)))
        gate, up = reference_linear(x.float(), w).chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        torch.testing.assert_close(lin.silu_mul(x).float(), ref, rtol=0.03, atol=0.03)
        portable = QuantLinear([w], None, None)  # no native library: linear, then SiLU
        assert not portable.fused_silu_capable
        torch.testing.assert_close(portable.silu_mul(x).float(), ref, rtol=0.03, atol=0.03)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel.linear_silu_mul(x, _random_weight("q4_1", 48, 192, seed=18))
