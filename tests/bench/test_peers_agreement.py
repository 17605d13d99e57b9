"""The peer harness's greedy-agreement logic (benchmarks/peers/agreement.py, agree.py) and
kvserve_greedy.py's option parsing: no llama.cpp, no model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import agree  # noqa: E402
import agreement  # noqa: E402
import kvserve_greedy  # noqa: E402


def test_first_divergence_positions() -> None:
    fd = agreement.first_divergence
    assert fd([1, 2, 3], [1, 2, 3]) is None
    assert fd([1, 2, 3], [9, 2, 3]) == 0
    assert fd([1, 2, 3], [1, 2, 4]) == 2
    assert fd([1, 2, 3], [1, 2]) == 2  # a strict prefix diverges at the shorter length
    assert fd([], []) is None
    assert fd([], [5]) == 0


def test_compare_figures() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1], [2, 2, 2, 2]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 1, 1, 1], [2, 2, 2, 2]]
    a = agreement.compare(ref, got)
    assert a.sequences == 4 and a.exact == 2
    assert a.divergences == [None, 2, 0, None]
    assert a.mean_first_divergence == pytest.approx(1.0)  # (2 + 0) / 2 diverging
    assert a.mean_common_prefix == pytest.approx((4 + 2 + 0 + 4) / 4)
    assert a.token_agreement == pytest.approx(10 / 16)
    assert "exact 2/4" in a.line() and "62.5%" in a.line()


def test_compare_identical_and_errors() -> None:
    a = agreement.compare([[3, 4], [5]], [[3, 4], [5]])
    assert a.exact == 2 and a.mean_first_divergence is None and a.token_agreement == 1.0
    assert "first divergence -" in a.line()
    with pytest.raises(ValueError, match="same order"):
        agreement.compare([[1]], [[1], [2]])
    with pytest.raises(ValueError, match="no sequences"):
        agreement.compare([], [])


def test_tokenization_mismatches() -> None:
    assert agreement.tokenization_mismatches([[1, 2], [3]], [[1, 2], [4]]) == [1]
    assert agreement.tokenization_mismatches([[1]], [(1,)]) == []
    with pytest.raises(ValueError):
        agreement.tokenization_mismatches([[1]], [])


def test_prompts_are_distinct_raw_text() -> None:
    assert len(agreement.PROMPTS) == 16 and len(set(agreement.PROMPTS)) == 16


def test_llamacpp_request_is_greedy_and_parsed() -> None:
    body = agree.completion_body([1, 2, 3], 64)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 64
    assert body["samplers"] == ["top_k"] and body["top_k"] == 1
    assert body["ignore_eos"] and body["return_tokens"] and not body["cache_prompt"]
    assert agree.parse_completion({"tokens": [7, 8], "content": "x"}, 2) == [7, 8]
    with pytest.raises(ValueError, match="without token ids"):
        agree.parse_completion({"content": "x"}, 2)
    with pytest.raises(ValueError, match="generated 1 tokens"):
        agree.parse_completion({"tokens": [7]}, 2)
    assert agree.parse_tokenize({"tokens": [4, 5]}) == [4, 5]
    assert agree.parse_tokenize({"tokens": [{"id": 4, "piece": "a"}]}) == [4]
    with pytest.raises(ValueError):
        agree.parse_tokenize({"error": "x"})


def test_configs_and_options() -> None:
    assert agree.parse_config("quantization=none, dtype=float32") == [
        "quantization=none",
        "dtype=float32",
    ]
    with pytest.raises(SystemExit):
        agree.parse_config("quantization")
    assert kvserve_greedy.parse_options(
        ["quantization=none", "dtype=float32", "max_num_seqs=4", "enable_prefix_caching=false"]
    ) == {
        "quantization": "none",
        "dtype": "float32",
        "max_num_seqs": 4,
        "enable_prefix_caching": False,
    }
    with pytest.raises(SystemExit):
        kvserve_greedy.parse_options(["=x"])


def test_summary_lines_from_report() -> None:
    a = agreement.compare([[1, 2]], [[1, 3]]).as_dict()
    report = {
        "date": "2026-12-01 17:00 UTC",
        "prompts": 1,
        "max_tokens": 2,
        "tokenization_mismatches": [],
        "kvserve": {
            "quantization=auto": {"vs_llamacpp": a, "vs_kvserve_dequantized": a},
            "quantization=none": {"vs_llamacpp": a},
        },
    }
    lines = agree.summary_lines(report)
    assert "1 prompts x 2 tokens" in lines[0]
    assert "exact  0/1" in lines[1] and "first div   1.0" in lines[1] and "50.0%" in lines[1]
    assert "vs kvserve dequantized: exact 0/1, 50.0%" in lines[1]
    assert "dequantized" not in lines[2]
