from __future__ import annotations

import argparse
import json

import pytest

from kvserve.bench.step_cost import (
    _parse_variants,
    build_prompts,
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


def test_variants():
    assert _parse_variants([]) == [("default", [])]
    assert _parse_variants(["b=--max-step-ms 120"]) == [("b", ["--max-step-ms", "120"])]
    with pytest.raises(ValueError, match="NAME=FLAGS"):
        _parse_variants(["--max-step-ms 120"])
