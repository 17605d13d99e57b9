from __future__ import annotations

import argparse
import json

import pytest

from kvserve.bench.step_cost import (
    RequestTimes,
    _parse_variants,
    build_prompts,
    format_comparison,
    stream_figures,
)


class _Tok:
    vocab_size = 1000

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def _args(**kw):
    base = dict(
        seed=3,
        jsonl=None,
        no_shuffle=False,
        workload="shared-prefix",
        num_requests=32,
        input_len=None,
        output_len=None,
        prefix_len=1024,
        num_prefixes=2,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_shared_prefix_prompts_have_the_vllm_bench_shape():
    prompts = build_prompts(_args(), _Tok())
    assert len(prompts) == 32
    assert {len(p) for p, _ in prompts} == {1024 + 64} and {n for _, n in prompts} == {64}
    prefixes = [tuple(p[:1024]) for p, _ in prompts]
    assert len(set(prefixes)) == 2 and prefixes.count(prefixes[0]) == 16
    assert len({tuple(p[1024:]) for p, _ in prompts}) == 32  # unique suffixes
    # shuffled: the two prefixes interleave rather than come in two halves
    assert len(set(prefixes[:16])) == 2
    ordered = build_prompts(_args(no_shuffle=True), _Tok())
    assert len({tuple(p[:1024]) for p, _ in ordered[:16]}) == 1


def test_random_and_jsonl_prompts(tmp_path):
    prompts = build_prompts(_args(workload="random", input_len=100, output_len=7), _Tok())
    assert len(prompts) == 32 and all(len(p) == 100 and n == 7 for p, n in prompts)
    f = tmp_path / "w.jsonl"
    f.write_text(
        "\n".join(json.dumps({"prompt": "a bb ccc", "output_tokens": k}) for k in (1, 2, 3))
    )
    rows = build_prompts(_args(jsonl=str(f), num_requests=None, no_shuffle=True), _Tok())
    assert rows == [([1, 2, 3], 1), ([1, 2, 3], 2), ([1, 2, 3], 3)]


def test_stream_figures_follow_vllm_bench_definitions():
    a = RequestTimes(added=0.0, tokens=[1.0, 1.1, 1.2, 1.5], num_tokens=4)
    b = RequestTimes(added=0.5, tokens=[1.5, 1.6], num_tokens=2)
    s = stream_figures([a, b], 2.0)
    assert s["output_tok_s"] == pytest.approx(3.0)
    assert s["mean_ttft_ms"] == pytest.approx(1000.0)
    assert s["mean_tpot_ms"] == pytest.approx((500 / 3 + 100) / 2)
    # gaps 100, 100, 300, 100 ms: p50 100, p99 the largest
    assert s["p50_itl_ms"] == pytest.approx(100.0)
    assert s["p99_itl_ms"] == pytest.approx(300.0)


def test_variants_and_comparison():
    assert _parse_variants([]) == [("default", [])]
    assert _parse_variants(["b=--max-step-ms 120"]) == [("b", ["--max-step-ms", "120"])]
    with pytest.raises(ValueError, match="NAME=FLAGS"):
        _parse_variants(["--max-step-ms 120"])
    res = {
        n: [{"streams": {"output_tok_s": v, "p99_itl_ms": 2 * v}, "all": {}}]
        for n, v in (("a", 100.0), ("b", 150.0))
    }
    text = format_comparison(res)
    assert "150.0 (1.50x)" in text and "300 (1.50x)" in text
