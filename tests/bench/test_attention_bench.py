"""``kvserve bench forward``'s decode-attention timing: distinct caches per layer."""

from __future__ import annotations

import torch

import kvserve.bench.attention_bench as ab


def _step(**kw: object) -> dict:
    args = dict(
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        batch=2,
        context=40,
        repeats=2,
    )
    args.update(kw)
    return ab.decode_attention_step(**args)  # type: ignore[arg-type]


def test_every_layer_reads_its_own_cache_while_they_fit() -> None:
    r = _step()
    assert r["num_caches"] == 3  # one per layer: the step streams 3 caches' KV
    assert r["step_ms"] > 0
    # K and V of every row's context and new token, every layer, fp32
    assert r["kv_bytes"] == 3 * 2 * 41 * 2 * 16 * 2 * 4


def test_layers_cycle_through_caches_past_the_span(monkeypatch) -> None:
    # a span of one cache: every layer reuses it (still timed layer by layer)
    per_cache = 2 * 2 * (1 + 2 * 3) * 16 * 16 * 4  # [2, Hk, blocks, block_size, D] fp32
    monkeypatch.setattr(ab, "CACHE_SPAN_BYTES", per_cache)
    assert _step()["num_caches"] == 1
    monkeypatch.setattr(ab, "CACHE_SPAN_BYTES", 2 * per_cache)
    assert _step()["num_caches"] == 2


def test_native_reads_touch_every_byte_they_claim() -> None:
    """read_slices / read_pages (the bandwidth limit's reads) OR every byte they read:
    a single set bit anywhere in the buffer, or in any page of the step, shows up."""
    from kvserve.model.kernels.backend import default_backend

    kernel = default_backend().attention
    if kernel is None:
        import pytest

        pytest.skip("no native kernels here")
    buf = torch.zeros(3 * 1000 + 7, dtype=torch.float32)  # odd size: the tail is read too
    for threads in (1, 2):
        assert kernel.read_slices(buf, threads) == 0
        for i in (0, 1500, buf.numel() - 1):
            buf.view(torch.int32)[i] = 1 << 9
            # the OR of little-endian 64-bit words: an odd 32-bit element is the high half
            assert kernel.read_slices(buf, threads) == 1 << (9 + 32 * (i % 2))
            buf.zero_()
    # 2 seqs over 5 blocks of 4 tokens, 2 KV heads, D 16, fp32
    kv = torch.zeros(2, 2, 5, 4, 16)
    seqs = torch.tensor([[0, 1, 1, 5, 0], [1, 1, 1, 2, 0]])  # 6 and 3 keys
    tables = torch.tensor([[3, 1], [4, 0]])
    assert kernel.read_pages(kv, seqs, tables, 2) == 0
    kv[1, 1, 1, 1, 15] = torch.tensor(1 << 20, dtype=torch.int32).view(torch.float32)
    assert kernel.read_pages(kv, seqs, tables, 2) == 1 << 52  # V, head 1, key 5 of seq 0
    kv.zero_()
    kv[0, 0, 1, 2, 0] = 1.0  # block 1, slot 2: seq 0's key 6 does not exist
    assert kernel.read_pages(kv, seqs, tables, 1) == 0


def test_limit_reads_sit_beside_every_repeat() -> None:
    """With limit_reads, each timed repeat gets its own stream sample, over a buffer as
    large as the step's caches, and the page read is timed too; the grid holds each
    native row against its own samples' median and reports their spread."""
    from kvserve.model.kernels.backend import default_backend

    if default_backend().attention is None:
        import pytest

        pytest.skip("no native kernels here")
    r = _step(repeats=3, limit_reads=True, context=2000)
    assert len(r["stream_read_gb_s"]) == 3 and all(x > 0 for x in r["stream_read_gb_s"])
    cache_bytes = 2 * 2 * (1 + 2 * 126) * 16 * 16 * 4  # [2, Hk, blocks, bs, D] fp32
    assert r["stream_read_bytes"] == 3 * cache_bytes  # one cache per layer
    assert r["page_read_ms"] > 0
    assert _step()["num_caches"] == 3 and "stream_read_gb_s" not in _step()

    from types import SimpleNamespace

    arch = SimpleNamespace(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    g = ab.run_attention_grid(arch, torch.float32, [1, 2], [40], ["native"], repeats=3)
    assert [(r["batch"], r["placement"]) for r in g["rows"]] == [
        (1, "engine"),
        (1, "random"),
        (2, "engine"),
        (2, "random"),
    ]
    for row in g["rows"]:
        lo, hi = row["read_bandwidth_spread"]
        assert lo <= row["read_bandwidth_gb_s"] <= hi
        assert row["limit_ms"] == row["kv_bytes"] / (row["read_bandwidth_gb_s"] * 1e9) * 1e3
        assert row["fraction_of_page_read"] == row["page_read_ms"] / row["step_ms"]
    assert len(g["stream_read_gb_s"]) == 12


def test_placements_engine_contiguous_random_scattered() -> None:
    """The engine rows use the real allocator's tables (one run per request here),
    the random row scatters them; an unknown placement is refused."""
    import pytest

    eng = _step(batch=4, context=300, placement="engine")
    rnd = _step(batch=4, context=300, placement="random")
    churn = _step(batch=4, context=300, placement="engine-churn")
    assert eng["placement"] == "engine" and eng["adjacent_blocks"] >= 0.9
    assert churn["adjacent_blocks"] >= 0.5
    assert rnd["adjacent_blocks"] < 0.3
    assert eng["kv_bytes"] == rnd["kv_bytes"]  # the same work, placed differently
    with pytest.raises(ValueError, match="placement"):
        _step(placement="sorted")
