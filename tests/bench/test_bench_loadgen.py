"""The load generator, report and CLI against a fake OpenAI-compatible SSE server.

The fake server (tests/support/bench_fake_server.py) is a test double for the HTTP protocol
only; a test against the real `kvserve serve` belongs with the server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.bench_fake_server import FakeState, ThreadServer, start_in_thread

from kvserve.bench.loadgen import SKIPPED, LoadConfig, run_workload
from kvserve.bench.metrics import SLO
from kvserve.bench.report import build_report, format_summary, write_report
from kvserve.bench.workloads import (
    Session,
    Turn,
    Workload,
    WorkloadSpec,
    build_workload,
    render_prompt,
)
from kvserve.entrypoints.cli import main as kvserve_main


@pytest.fixture
def server() -> Iterator[ThreadServer]:
    srv = start_in_thread(FakeState(delay_ms=1.0))
    yield srv
    srv.stop()


def config(srv: ThreadServer, **kw: object) -> LoadConfig:
    return LoadConfig(base_url=srv.base_url, progress=False, **kw)  # type: ignore[arg-type]


def test_streams_every_request_with_exact_token_timings(server: ThreadServer) -> None:
    w = build_workload(WorkloadSpec(kind="random", num_requests=6, input_len=12, output_len=8))
    run = run_workload(w, config(server, max_concurrency=2))
    assert run.model == "fake-model"  # resolved from /v1/models
    assert len(run.results) == 6 and all(r.success for r in run.results)
    for r in run.results:
        assert len(r.chunk_times) == 8 and r.output_tokens == 8
        assert r.num_prompt_tokens == 12 and r.prompt_len == 12
        assert r.generated_text == "".join(f" t{i}" for i in range(8))
        assert (
            0 <= r.send_time < r.chunk_times[0] <= r.chunk_times[-1] <= r.end_time <= run.duration_s
        )
        assert r.tpot is not None and len(r.itls) == 7
    assert server.state.max_in_flight == 2
    body = server.state.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 8 and body["model"] == "fake-model"


def test_multi_turn_resends_history_with_answers(server: ThreadServer) -> None:
    w = build_workload(
        WorkloadSpec(kind="multi-turn", num_requests=6, turns=3, input_len=4, output_len=3)
    )
    run = run_workload(w, config(server, model="fake-model"))
    assert all(r.success for r in run.results)
    answer = " t0 t1 t2"
    for s in w.sessions:
        prompts = [
            b["prompt"] for b in server.state.bodies if b["prompt"].startswith(s.turns[0].user_text)
        ]
        assert prompts == [render_prompt(s, k, [answer] * k) for k in range(3)]
    for r in run.results:
        assert r.prompt_len == 4 * (r.turn + 1) + 3 * r.turn
    # the history is a prefix of the next turn: the server saw cached tokens
    delta = run.prefix_cache
    assert delta is not None and delta["hits"] > 0
    assert delta["hit_rate"] == pytest.approx(
        sum(r.num_cached_tokens or 0 for r in run.results)
        / sum(r.num_prompt_tokens or 0 for r in run.results)
    )


def test_chat_endpoint_counts_content_chunks_only(server: ThreadServer) -> None:
    w = build_workload(
        WorkloadSpec(kind="multi-turn", num_requests=2, turns=2, input_len=3, output_len=5)
    )
    run = run_workload(w, config(server, endpoint="chat"))
    assert all(r.success and len(r.chunk_times) == 5 for r in run.results)
    second = server.state.bodies[-1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] == " t0 t1 t2 t3 t4"


def test_errors_are_recorded_and_later_turns_skipped(server: ThreadServer) -> None:
    failing = Session(0, "", 0, (Turn(" please FAIL now", 3, 4), Turn(" again", 1, 4)))
    fine = Session(1, "", 0, (Turn(" all good here", 3, 4),))
    w = Workload(WorkloadSpec(), (failing, fine), exact_lengths=False)
    run = run_workload(w, config(server))
    by_id = {(r.session_id, r.turn): r for r in run.results}
    assert by_id[(0, 0)].error.startswith("HTTP 400") and not by_id[(0, 0)].success
    assert by_id[(0, 1)].error == SKIPPED
    assert by_id[(1, 0)].success
    report = build_report(
        run.results, run.duration_s, w, SLO(), run.config_json(), run.prefix_cache
    )
    assert report["summary"]["failed"] == 2 and report["summary"]["completed"] == 1
    assert report["summary"]["errors"][SKIPPED] == 1
    assert "HTTP 400" in format_summary(report)


def test_api_key_is_sent_as_bearer_token() -> None:
    srv = start_in_thread(FakeState(api_key="sekret"))
    try:
        w = build_workload(WorkloadSpec(kind="random", num_requests=2, input_len=3, output_len=2))
        denied = run_workload(w, config(srv, model="fake-model"))
        assert all(r.error.startswith("HTTP 401") for r in denied.results)
        allowed = run_workload(w, config(srv, model="fake-model", api_key="sekret"))
        assert all(r.success for r in allowed.results)
    finally:
        srv.stop()


def test_report_writes_results_json_and_pngs(server: ThreadServer, tmp_path: Path) -> None:
    w = build_workload(WorkloadSpec(kind="random", num_requests=4, input_len=5, output_len=6))
    run = run_workload(w, config(server, request_rate=50.0))
    report = build_report(
        run.results, run.duration_s, w, SLO(ttft_ms=10_000), run.config_json(), run.prefix_cache
    )
    paths = write_report(report, run.results, tmp_path / "out", title="random")
    assert {p.name for p in paths} == {
        "results.json",
        "ttft_cdf.png",
        "itl_cdf.png",
        "timeline.png",
    }
    for p in paths[1:]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["summary"]["completed"] == 4 and data["summary"]["good_requests"] == 4
    assert data["config"]["request_rate"] == 50.0 and data["workload"]["num_requests"] == 4
    assert len(data["requests"]) == 4 and len(data["requests"][0]["chunk_times"]) == 6


def test_cli_bench_serve_end_to_end(
    server: ThreadServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve"
    argv = ["bench", "serve", "--base-url", server.base_url + "/v1", "--workload", "shared-prefix"]
    argv += ["--num-requests", "6", "--num-prefixes", "2", "--prefix-len", "20", "--input-len", "5"]
    argv += [
        "--output-len",
        "4",
        "--request-rate",
        "inf",
        "--max-concurrency",
        "3",
        "--slo-ttft",
        "5000",
    ]
    argv += ["--output", str(out), "--no-progress"]
    assert kvserve_main(argv) == 0
    printed = capsys.readouterr().out
    assert "prefix cache hit rate (server):" in printed and "successful requests:" in printed
    data = json.loads((out / "results.json").read_text())
    s = data["summary"]
    assert s["completed"] == 6 and s["total_output_tokens"] == 24
    assert s["prefix_cache_hit_rate"] == pytest.approx(s["client_cache_hit_rate"])
    assert s["prefix_cache_hit_rate"] >= 4 * 20 / (6 * 25)  # all but the first of each group hit 20
    assert (out / "timeline.png").exists()


def test_cli_rejects_bad_values_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvserve_main(["bench", "serve", "--input-len", "0", "--no-progress"]) == 2
    assert "--input-len" in capsys.readouterr().err
    assert kvserve_main(["bench", "serve", "--base-url", "localhost:8000"]) == 2
    assert "http://" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.model
def test_bench_serve_against_the_real_server(tmp_path: Path, kvserve_server) -> None:
    """A short run against `kvserve serve` with the default model (the session's
    server, so no start of its own; it needs the API key): exact prompt and output
    lengths, and the server's prefix-cache counters move."""
    out = tmp_path / "real"
    argv = ["bench", "serve", "--base-url", kvserve_server.base_url, "--workload", "shared-prefix"]
    argv += ["--api-key", kvserve_server.api_key]
    argv += ["--num-requests", "4", "--num-prefixes", "1", "--prefix-len", "64"]
    argv += ["--input-len", "16", "--output-len", "8", "--max-concurrency", "1"]
    argv += ["--tokenizer", "smollm2-135m-instruct", "--output", str(out), "--no-progress"]
    assert kvserve_main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["summary"]["completed"] == 4 and data["workload"]["exact_lengths"] is True
    for r in data["requests"]:
        assert r["num_prompt_tokens"] == 80 and r["num_output_tokens"] == 8
        assert len(r["chunk_times"]) >= 1
    # one request at a time: the 2nd..4th find the 64-token prefix cached
    assert data["prefix_cache"]["hits"] >= 3 * 64
    assert data["summary"]["prefix_cache_hit_rate"] > 0.5
