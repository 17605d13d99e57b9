"""kvserve.bench.step_cost_report: error summaries, stream figures, comparison."""

from __future__ import annotations

import pytest

from kvserve.bench.step_cost_report import (
    RequestTimes,
    format_comparison,
    stream_figures,
    summarize_errors,
)


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


def test_error_summary():
    records = [
        {"predicted_ms": p, "measured_ms": m} for p, m in ((11.0, 10.0), (8.0, 10.0), (20.0, 10.0))
    ]
    s = summarize_errors(records)
    assert s["steps"] == 3
    assert s["median_abs_error"] == pytest.approx(0.2)  # |err| 0.1, 0.2, 1.0
    assert s["within_15pct"] == pytest.approx(1 / 3)
    assert s["mean_signed_error"] == pytest.approx((0.1 - 0.2 + 1.0) / 3)
    assert summarize_errors([]) == {"steps": 0}


def test_comparison_reports_ratios_to_the_first_variant():
    res = {
        n: [{"streams": {"output_tok_s": v, "p99_itl_ms": 2 * v}, "all": {}}]
        for n, v in (("a", 100.0), ("b", 150.0))
    }
    text = format_comparison(res)
    assert "150.0 (1.50x)" in text and "300 (1.50x)" in text
