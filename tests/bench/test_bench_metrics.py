"""Metric arithmetic of kvserve.bench on synthetic timings with exact expected values."""

from __future__ import annotations

import pytest

from kvserve.bench.metrics import (
    SLO,
    RequestResult,
    parse_prefix_cache_counters,
    percentile,
    prefix_cache_delta,
    summarize,
    summarize_by_tag,
    token_timeline,
)


def result(
    send: float, chunks: list[float], end: float, n_out: int | None = None, **kw: object
) -> RequestResult:
    return RequestResult(
        session_id=0,
        turn=0,
        prompt_len=10,
        output_len=len(chunks),
        send_time=send,
        chunk_times=chunks,
        end_time=end,
        success=True,
        num_output_tokens=n_out,
        **kw,  # type: ignore[arg-type]
    )


def test_percentile_interpolates_linearly() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile([], 50) is None


def test_request_ttft_itl_e2e_tpot() -> None:
    r = result(1.0, [1.2, 1.25, 1.35, 1.4], 1.5, n_out=4)
    assert r.ttft == pytest.approx(0.2)
    assert r.itls == pytest.approx([0.05, 0.1, 0.05])
    assert r.e2e == pytest.approx(0.5)
    assert r.tpot == pytest.approx((0.5 - 0.2) / 3)


def test_tpot_uses_usage_tokens_not_chunks() -> None:
    # 8 tokens delivered in 4 chunks: TPOT divides by 7, ITL still has 3 gaps
    r = result(0.0, [0.1, 0.2, 0.3, 0.4], 0.45, n_out=8)
    assert r.output_tokens == 8
    assert r.tpot == pytest.approx((0.45 - 0.1) / 7)
    assert len(r.itls) == 3
    # without usage the chunk count stands in
    assert result(0.0, [0.1, 0.2], 0.2).output_tokens == 2


def test_single_token_request_has_no_tpot() -> None:
    r = result(0.0, [0.3], 0.3, n_out=1)
    assert r.tpot is None
    assert r.itls == []


def test_summarize_exact_figures() -> None:
    results = [
        result(0.0, [0.1, 0.2, 0.3], 0.3, n_out=3),  # ttft 100, tpot 100, e2e 300
        result(0.5, [0.8, 0.9, 1.0, 1.1, 1.2], 1.2, n_out=5),  # ttft 300, tpot 100, e2e 700
        RequestResult(1, 0, 10, 5, 0.6, end_time=0.7, error="HTTP 503: busy"),
    ]
    s = summarize(results, duration_s=2.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["num_requests"] == 3
    assert s["total_output_tokens"] == 8
    assert s["total_input_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(14.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 200)
    assert s["mean_tpot_ms"] == pytest.approx(100.0)
    assert s["mean_itl_ms"] == pytest.approx(100.0)
    assert s["mean_e2e_ms"] == pytest.approx(500.0)
    assert s["p90_e2e_ms"] == pytest.approx(300 + 0.9 * 400)
    assert s["errors"] == {"HTTP 503: busy": 1}
    assert s["goodput"] is None and s["good_requests"] is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    results = [
        result(0.0, [0.1, 0.2, 0.3], 0.3, n_out=3),  # ttft 100, tpot 100
        result(0.0, [0.3, 0.35, 0.4], 0.4, n_out=3),  # ttft 300: misses TTFT
        result(0.0, [0.1, 0.5], 0.5, n_out=2),  # tpot 400: misses TPOT
        result(0.0, [0.2], 0.2, n_out=1),  # one token: TPOT counts as 0
    ]
    s = summarize(results, duration_s=4.0, slo=SLO(ttft_ms=250, tpot_ms=150))
    assert s["good_requests"] == 2
    assert s["goodput"] == pytest.approx(0.5)
    assert summarize(results, 4.0, SLO(ttft_ms=250))["good_requests"] == 3
    assert summarize(results, 4.0, SLO(e2e_ms=350))["good_requests"] == 2  # e2e 300 and 200


def test_slo_validation_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--slo-ttft"):
        SLO(ttft_ms=-1).validate()


def test_unstreamed_results_have_no_itl_or_tpot() -> None:
    r = result(0.0, [2.0], 2.0, n_out=16, streamed=False)
    s = summarize([r], duration_s=2.0)
    assert s["mean_ttft_ms"] == pytest.approx(2000.0)
    assert s["mean_tpot_ms"] is None and s["mean_itl_ms"] is None
    assert s["output_throughput"] == pytest.approx(8.0)


def test_client_cache_hit_rate_from_usage() -> None:
    a = result(0.0, [0.1], 0.1, n_out=1, num_prompt_tokens=100, num_cached_tokens=0)
    b = result(0.0, [0.1], 0.1, n_out=1, num_prompt_tokens=100, num_cached_tokens=80)
    s = summarize([a, b], 1.0)
    assert s["client_cached_tokens"] == 80
    assert s["client_cache_hit_rate"] == pytest.approx(0.4)
    assert summarize([result(0.0, [0.1], 0.1)], 1.0)["client_cache_hit_rate"] is None


def test_summarize_by_tag_splits_groups() -> None:
    a = result(0.0, [0.1, 0.2], 0.2, n_out=2, tag="decode")
    b = result(0.0, [1.0], 1.0, n_out=1, tag="prefill")
    by_tag = summarize_by_tag([a, b], 1.0)
    assert set(by_tag) == {"decode", "prefill"}
    assert by_tag["decode"]["mean_ttft_ms"] == pytest.approx(100.0)
    assert by_tag["prefill"]["mean_ttft_ms"] == pytest.approx(1000.0)
    assert summarize_by_tag([a], 1.0) == {}


def test_token_timeline_bins_tokens_per_second() -> None:
    a = result(0.0, [0.1, 0.6, 1.1], 1.1, n_out=3)
    b = result(0.0, [0.2, 0.3], 0.3, n_out=4)  # 2 tokens per chunk
    starts, rates = token_timeline([a, b], bin_s=0.5)
    assert starts == pytest.approx([0.0, 0.5, 1.0])
    assert rates == pytest.approx([(1 + 4) / 0.5, 1 / 0.5, 1 / 0.5])
    with pytest.raises(ValueError, match="bin_s"):
        token_timeline([a], bin_s=0)


KVSERVE_METRICS = """# HELP kvserve:prefix_cache_queries Prefix cache queries.
# TYPE kvserve:prefix_cache_queries counter
kvserve:prefix_cache_queries_total{model_name="m"} 1000.0
# HELP kvserve:prefix_cache_hits Prefix cache hits.
# TYPE kvserve:prefix_cache_hits counter
kvserve:prefix_cache_hits_total{model_name="m"} 250.0
# HELP kvserve:num_requests_running Running.
# TYPE kvserve:num_requests_running gauge
kvserve:num_requests_running 3.0
"""

VLLM_METRICS = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 400.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 300.0
"""


def test_parse_prefix_cache_counters_kvserve_and_vllm() -> None:
    assert parse_prefix_cache_counters(KVSERVE_METRICS) == {
        "source": "kvserve:prefix_cache_queries",
        "queries": 1000.0,
        "hits": 250.0,
    }
    assert parse_prefix_cache_counters(VLLM_METRICS) == {
        "source": "vllm:prefix_cache_queries",
        "queries": 1000.0,
        "hits": 400.0,
    }
    assert parse_prefix_cache_counters("# TYPE other counter\nother_total 1.0\n") is None


def test_prefix_cache_delta_over_the_run() -> None:
    before = {"source": "kvserve:prefix_cache_queries", "queries": 1000.0, "hits": 250.0}
    after = {"source": "kvserve:prefix_cache_queries", "queries": 3000.0, "hits": 1750.0}
    delta = prefix_cache_delta(before, after)
    assert delta is not None
    assert delta["queries"] == 2000.0 and delta["hits"] == 1500.0
    assert delta["hit_rate"] == pytest.approx(0.75)
    assert prefix_cache_delta(before, before)["hit_rate"] is None  # type: ignore[index]
    assert prefix_cache_delta(None, after) is None
