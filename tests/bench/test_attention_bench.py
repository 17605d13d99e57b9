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
