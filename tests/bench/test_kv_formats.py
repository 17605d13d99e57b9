"""``bench forward --kv-formats``: the attention rows run every format on the same
shapes and count each format's KV bytes (timings are not checked)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvserve.bench.kv_formats import attention_rows
from kvserve.model.kernels.backend import default_backend


@pytest.mark.skipif(default_backend().attention is None, reason="native kernels unavailable")
def test_attention_rows_cover_every_format():
    arch = SimpleNamespace(num_layers=2, num_heads=6, num_kv_heads=2, head_dim=64)
    rows = attention_rows(
        arch, torch.bfloat16, ["auto", "int8", "fp8_e4m3"], [2], [64], 10.0, rounds=1
    )
    assert [r["kv_format"] for r in rows] == ["bfloat16", "int8", "fp8_e4m3"]
    assert rows[0]["vs_first"] == 1.0 and all(r["step_ms"] > 0 for r in rows)
    # KV read: layers x batch x (context + 1) x Hk x (K, V) x row bytes
    assert rows[0]["kv_mb"] == pytest.approx(2 * 2 * 65 * 2 * 2 * 128 / 1e6)
    assert rows[1]["kv_mb"] == pytest.approx(2 * 2 * 65 * 2 * 2 * 68 / 1e6)
