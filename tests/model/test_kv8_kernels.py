"""8-bit KV cache kernels: codec, write, attention (portable vs AVX-512 vs PyTorch)."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.model.kernels.kv8 import (
    dequantize_rows,
    get_kv8_kernel,
    pages_to_rows,
    quantize_cache,
    quantize_rows,
    resolve_kv_cache_dtype,
    rows_to_pages,
)

try:
    KERNEL = get_kv8_kernel()
except RuntimeError:  # no compiler
    KERNEL = None

needs_kernel = pytest.mark.skipif(KERNEL is None, reason="native kernels unavailable")
FORMATS = [torch.int8, torch.uint8]  # int8, fp8_e4m3


def dequantize_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """A whole 8-bit layer cache -> float32 ``[2, Hk, blocks, block_size, D]`` (the
    reference codec's inverse of ``quantize_cache``)."""
    if kv_cache.dtype == torch.int8:
        return dequantize_rows(pages_to_rows(kv_cache))
    return dequantize_rows(kv_cache)


def _cache(hk: int, blocks: int, bs: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    x = torch.randn(2, hk, blocks, bs, d, generator=gen) * 2.0
    return quantize_cache(x, dtype).contiguous()


def _reference(q, cache8, seqs, tables, scale, seg=0):
    """PyTorch attention over the dequantized cache, per (seq, row, head)."""
    kv = dequantize_cache(cache8)  # [2, Hk, blocks, bs, D]
    _, hk, _, bs, d = kv.shape
    h = q.shape[1]
    g = h // hk
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:2], -math.inf)
    for s in range(seqs.shape[0]):
        start, rows, ntok, ctx, prior_only = (int(x) for x in seqs[s])
        for j in range(ntok):
            n = ctx if prior_only else ctx + j + 1
            if n == 0:
                continue
            pos = torch.arange(n)
            blk = tables[s][pos // bs]
            keys = kv[0][:, blk, pos % bs]  # [Hk, n, D]
            vals = kv[1][:, blk, pos % bs]
            for head in range(h):
                sc = keys[head // g] @ q[start + j, head].float() * scale
                p = torch.softmax(sc, -1)
                out[start + j, head] = p @ vals[head // g]
                lse[start + j, head] = torch.logsumexp(sc, -1)
    return out, lse


def test_resolve_kv_cache_dtype():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16).name == "bfloat16"
    assert resolve_kv_cache_dtype(None, torch.float32).torch_dtype == torch.float32
    assert resolve_kv_cache_dtype("int8", torch.bfloat16).row_bytes(64) == 68
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16).torch_dtype == torch.uint8
    assert resolve_kv_cache_dtype("fp8", torch.float32).name == "fp8_e4m3"  # vLLM's alias
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16).torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'.*int8"):
        resolve_kv_cache_dtype("int4", torch.bfloat16)
    with pytest.raises(ValueError, match="float KV cache holds the model dtype"):
        resolve_kv_cache_dtype("float32", torch.bfloat16)


@pytest.mark.parametrize("dtype", FORMATS)
def test_codec_roundtrip_error(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=gen)
    y = dequantize_rows(quantize_rows(x, dtype))
    amax = x.abs().amax(-1, keepdim=True)
    err = ((y - x).abs() / amax).max().item()
    # int8: half a step of amax/127; fp8 e4m3: 3 mantissa bits (1/16 relative) of 448
    assert err <= (0.5 / 127 + 1e-6 if dtype == torch.int8 else 1 / 16 + 1e-6)
    assert err > 0  # it is quantized
    zero = dequantize_rows(quantize_rows(torch.zeros(2, 64), dtype))
    assert torch.equal(zero, torch.zeros(2, 64))


@pytest.mark.parametrize("bs", [16, 4, 1])
def test_int8_pages_roundtrip(bs):
    gen = torch.Generator().manual_seed(bs)
    rows = quantize_rows(torch.randn(2, 2, 3, bs, 64, generator=gen), torch.int8)
    pages = rows_to_pages(rows)
    assert not torch.equal(pages, rows) or bs == 1
    assert torch.equal(pages_to_rows(pages), rows)
    torch.testing.assert_close(dequantize_cache(pages), dequantize_rows(rows))


@needs_kernel
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_native_write_matches_reference_codec(dtype, src):
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(1)
    t, hk, d, blocks, bs = 7, 3, 64, 5, 4
    kv_rows = (torch.randn(t, 2, hk, d, generator=gen) * 3).to(src)
    k, v = kv_rows[:, 0], kv_rows[:, 1]
    cache = torch.zeros(2, hk, blocks, bs, d + 4, dtype=dtype)
    slots = torch.tensor([4, 5, 6, -1, 9, 10, 19], dtype=torch.int64)
    KERNEL.write(k, v, cache, slots)
    if dtype == torch.int8:
        cache = pages_to_rows(cache)
    flat = cache.view(2, hk, -1, d + 4)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(flat[0, :, s], quantize_rows(k[i], dtype)), i
        assert torch.equal(flat[1, :, s], quantize_rows(v[i], dtype)), i
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert int(flat[:, :, untouched].view(torch.uint8).abs().sum()) == 0


def _batch(gen, hk, d, g, bs, blocks):
    # (start, rows, num_tokens, ctx, prior_only): decode rows, a prefill chunk with a
    # prior context and padding, a prior-only chunk, a fresh prefill
    specs = [(1, 1, 57), (1, 1, 300), (6, 5, 37), (3, 3, 20), (4, 4, 0)]
    rows, seqs, tables = 0, [], []
    nbt = max(-(-(c + r) // bs) for r, _, c in specs) + 1
    perm = torch.randperm(blocks - 1, generator=gen) + 1
    used = 0
    for i, (r, n, c) in enumerate(specs):
        prior_only = 1 if i == 3 else 0
        seqs.append((rows, r, n, c, prior_only))
        need = -(-(c + r) // bs)
        t = torch.zeros(nbt, dtype=torch.int64)
        t[:need] = perm[used : used + need]
        used += need
        tables.append(t)
        rows += r
    q = torch.randn(rows, hk * g, d, generator=gen)
    return q, torch.tensor(seqs, dtype=torch.int64), torch.stack(tables)


@needs_kernel
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("d", [64, 128, 32])
@pytest.mark.parametrize("seg", [0, 64])
def test_attention_portable_avx512_reference(dtype, d, seg):
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(d + seg)
    hk, g, bs, blocks = 2, 3, 16, 64
    q, seqs, tables = _batch(gen, hk, d, g, bs, blocks)
    cache = _cache(hk, blocks, bs, d, dtype, gen)
    scale = d**-0.5
    fast = KERNEL.int8_vnni if dtype == torch.int8 else KERNEL.avx512
    if dtype == torch.int8:
        # int8 runs on queries quantized per row (int8, amax / 127) and P.V weights
        # quantized per part (int16): the reference gets the same queries, and the
        # int16 weights' rounding is the tolerance; fp8 runs fp32 arithmetic
        qs = q.abs().amax(-1, keepdim=True) / 127
        ref, ref_lse = _reference(
            (q / qs).round().clamp(-127, 127) * qs, cache, seqs, tables, scale
        )
        tol = {"atol": 2e-3, "rtol": 1e-3}
    else:
        ref, ref_lse = _reference(q, cache, seqs, tables, scale)
        tol = {"atol": 2e-5, "rtol": 1e-4}
    results = {}
    for isa in ["portable", "avx512"] if fast else ["portable"]:
        lse = torch.full(q.shape[:2], -math.inf)
        out = KERNEL.attention(q, cache, seqs, tables, seg, scale, lse=lse, isa=isa)
        results[isa] = (out, lse)
        valid = torch.isfinite(ref_lse)
        torch.testing.assert_close(out, ref, **tol)
        torch.testing.assert_close(lse[valid], ref_lse[valid], **tol)
        assert torch.isinf(lse[~valid]).all()
        # padding rows (seq 2's rows 5) are zero
        assert torch.count_nonzero(out[2 + 5]) == 0
    if len(results) == 2:  # the same arithmetic: equal up to float rounding order
        (po, pl), (vo, vl) = results["portable"], results["avx512"]
        torch.testing.assert_close(po, vo, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pl, vl, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("isa", ["portable", "avx512"])
def test_row_result_independent_of_batch_and_chunking(isa):
    """A row's output is bit-identical alone, in a batch, or inside a prefill chunk."""
    assert KERNEL is not None
    if isa == "avx512" and not KERNEL.int8_vnni:
        pytest.skip("no AVX512-VNNI")
    gen = torch.Generator().manual_seed(3)
    hk, g, d, bs, blocks = 2, 3, 64, 16, 80
    cache = _cache(hk, blocks, bs, d, torch.int8, gen)
    table = (torch.randperm(blocks - 1, generator=gen)[:70] + 1).view(1, -1)
    q = torch.randn(40, hk * g, d, generator=gen, dtype=torch.bfloat16)
    scale = 0.125
    # positions 1000..1039 as one 40-row chunk over a 1000-token prefix
    chunk = KERNEL.attention(
        q, cache, torch.tensor([[0, 40, 40, 1000, 0]]), table, 512, scale, isa=isa
    )
    # the same positions as decode rows, batched with another request
    other = torch.randn(1, hk * g, d, generator=gen, dtype=torch.bfloat16)
    for j in (0, 17, 39):
        qq = torch.cat([other, q[j : j + 1]])
        seqs = torch.tensor([[0, 1, 1, 200, 0], [1, 1, 1, 1000 + j, 0]])
        tables = torch.cat([table, table])
        out = KERNEL.attention(qq, cache, seqs, tables, 512, scale, isa=isa)
        assert torch.equal(out[1], chunk[j]), j
        alone = KERNEL.attention(
            q[j : j + 1], cache, torch.tensor([[0, 1, 1, 1000 + j, 0]]), table, 512, scale, isa=isa
        )
        assert torch.equal(alone[0], chunk[j]), j
