"""Scale-out surface without a cluster: flags, errors, metrics merging, imports."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.cluster.cluster_metrics import RouterMetrics, label_replicas
from kvserve.cluster.policy import Decision
from kvserve.entrypoints import serve_cmd


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    return serve_cmd.run(parser.parse_args(argv))


def test_single_process_server_never_imports_ray() -> None:
    code = (
        "import sys, kvserve.entrypoints.cli, kvserve.entrypoints.serve_cmd, "
        "kvserve.entrypoints.openai_server, kvserve.engine.async_engine; "
        "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_disaggregated_pools_are_refused_with_the_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _run(["--prefill-replicas", "1", "--decode-replicas", "1"]) == 2
    err = capsys.readouterr().err
    assert "not available yet" in err and "--replicas N" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "1"], "at least 2 replicas"),
        (["--replicas", "2", "--hash-algo", "builtin"], "--hash-algo sha256"),
        (["--replicas", "2", "--block-size", "3"], "block_size"),
        (["--replicas", "2", "--model", "/nonexistent/model"], "unknown model"),
    ],
)
def test_bad_replica_options_fail_before_ray_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(argv) == 2
    assert message in capsys.readouterr().err


def test_replica_texts_merge_with_a_replica_label() -> None:
    text = (
        "# HELP kvserve:prefix_cache_hits_total Hits.\n"
        "# TYPE kvserve:prefix_cache_hits_total counter\n"
        'kvserve:prefix_cache_hits_total{model_name="m"} %s\n'
        "# HELP kvserve:num_requests_running Running.\n"
        "# TYPE kvserve:num_requests_running gauge\n"
        'kvserve:num_requests_running{model_name="m"} 1.0\n'
    )
    merged = label_replicas({"r2": text % "5.0", "r1": text % "3.0"}).decode()
    samples = {
        (s.name, s.labels["replica"]): s.value
        for f in text_string_to_metric_families(merged)
        for s in f.samples
    }
    assert samples[("kvserve:prefix_cache_hits_total", "r1")] == 3.0
    assert samples[("kvserve:prefix_cache_hits_total", "r2")] == 5.0
    assert merged.count("# TYPE kvserve:prefix_cache_hits_total counter") == 1
    with pytest.raises(ValueError, match="r3"):
        label_replicas({"r3": "not { prometheus"})


def test_router_metrics_count_decisions_and_fractions() -> None:
    m = RouterMetrics()
    m.observe(Decision("r1", "prefix-aware", "prefix_hit", 3, 4, ("r1", "r2")))
    m.observe(Decision("r2", "round-robin", "round_robin", 0, 4, ("r2", "r1")))
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
    }
    key = ("kvserve:router_decisions_total", (("policy", "prefix-aware"), ("reason", "prefix_hit")))
    assert values[key] == 1.0
    assert values[("kvserve:router_matched_prefix_fraction_sum", ())] == pytest.approx(0.75)
    assert values[("kvserve:router_matched_prefix_fraction_count", ())] == 1.0
