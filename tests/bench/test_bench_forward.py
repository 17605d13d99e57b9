"""``kvserve bench forward``: prefill over cached prefixes and the FLOP-limit fraction."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvserve.bench import forward, forward_args
from kvserve.bench.forward_drivers import KvserveDriver


def test_cached_list_parses_and_refuses_bad_input() -> None:
    assert forward_args._cached_list("512@2048, 256@4096") == [(512, 2048), (256, 4096)]
    assert forward_args._cached_list("none") == []
    for bad in ("512", "a@b", "1@100", "64@0"):
        with pytest.raises(argparse.ArgumentTypeError, match="NEW"):
            forward_args._cached_list(bad)


def test_prefill_flops_counts_linears_head_and_attention() -> None:
    arch = SimpleNamespace(
        num_heads=4,
        head_dim=8,
        num_kv_heads=2,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        vocab_size=100,
    )
    per_layer = 32 * (4 + 4) * 8 + 32 * 32 + 3 * 32 * 64
    linear = 2 * 3 * per_layer * 10 + 2 * 32 * 100
    assert forward.prefill_flops(arch, 10) == linear + 4 * 3 * 4 * 8 * 50
    # 10 new tokens over 20 cached: 200 more query-key pairs per head and layer
    assert forward.prefill_flops(arch, 10, 20) == linear + 4 * 3 * 4 * 8 * (200 + 50)


@pytest.mark.slow
def test_run_reports_cached_prefill_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """End to end on the real model: the chunk-over-cached-prefix step samples the same
    greedy token as prefilling the whole prompt in one step, and every prefill row
    carries its fraction of the FLOP limit."""
    parser = argparse.ArgumentParser()
    forward.add_arguments(parser)
    out = tmp_path / "r.json"
    args = parser.parse_args(
        ["--dtype", "float32", "--quantization", "none", "--prefill-lens", "96", "--cached-prefill", "40@56",
         "--decode-batches", "1", "--decode-steps", "1", "--repeats", "1", "--no-hf",
         "--attention-backends", "none", "--json", str(out)]
    )  # fmt: skip
    assert forward.run(args) == 0
    r = json.loads(out.read_text())
    row = r["cached_prefill"]["40@56"]
    assert row["new_tokens"] == 40 and row["cached_tokens"] == 56
    assert row["kvserve_tok_s"] > 0 and 0 < row["fraction_of_flop_limit"] < 1.5
    assert 0 < r["prefill"]["96"]["fraction_of_flop_limit"] < 1.5
    assert r["matmul_gflop_s"] > 0
    assert "prefill 40@56 tok/s" in capsys.readouterr().out


@pytest.mark.slow
def test_prefill_cached_matches_a_whole_prefill() -> None:
    import torch

    from kvserve.model.loader import load_model

    loaded = load_model("smollm2-135m-instruct", dtype="float32")
    kv = KvserveDriver(loaded, 16, 512, 40)
    prompt = torch.randint(100, 10000, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = next(iter(kv.prefill([prompt]).values()))
    kv.prefill([prompt[:50]], reserve=40)
    blocks = next(iter(kv.live.values()))["blocks"]
    kv.prefill_cached(prompt, 50, blocks)
    assert next(iter(kv.live.values()))["last"] == whole
