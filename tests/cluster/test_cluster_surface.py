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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-replicas", "1"], "need both --prefill-replicas and --decode-replicas"),
        (["--prefill-replicas", "0", "--decode-replicas", "1"], "invalid --prefill-replicas 0"),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--replicas", "2"],
            "cannot be combined with --prefill-replicas",
        ),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-address", "x:1"],
            "set per replica",
        ),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer-timeout", "0"],
            "--kv-transfer-timeout",
        ),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--min-healthy-replicas", "3"],
            "use 1 to --prefill-replicas + --decode-replicas (2)",
        ),
    ],
)
def test_bad_pool_options_fail_before_ray_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(argv) == 2
    assert message in capsys.readouterr().err


def test_pool_replicas_carry_their_role() -> None:
    text = (
        "# HELP kvserve:num_requests_running Running.\n"
        "# TYPE kvserve:num_requests_running gauge\n"
        'kvserve:num_requests_running{model_name="m"} 1.0\n'
    )
    merged = label_replicas({"p": text, "d": text}, {"p": "prefill", "d": "decode"}).decode()
    assert 'replica="p",role="prefill"' in merged and 'replica="d",role="decode"' in merged
    metrics = RouterMetrics()
    metrics.set_pool_sizes({"prefill": 1, "decode": 2})
    assert 'kvserve:cluster_pool_replicas{role="decode"} 2.0' in metrics.render().decode()


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


def test_the_ingress_applies_the_server_options_one_engine_would() -> None:
    """Tool calling, --seed, --max-logprobs and request logging are the ingress's own
    (it renders and parses as one server does), so --replicas passes them on."""
    from kvserve.entrypoints.serve_replicas import ingress_options

    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    argv = ["--replicas", "2", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    argv += ["--seed", "7", "--max-logprobs", "3", "--enable-log-requests"]
    assert ingress_options(parser.parse_args(argv)) == {
        "tool_parser": "hermes",
        "enable_auto_tool_choice": True,
        "default_seed": 7,
        "max_logprobs": 3,
        "log_requests": True,
    }


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


def test_local_cluster_replicas_bind_serve_grpc_to_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray Serve binds each replica's inter-deployment gRPC server to [::]; in a local
    cluster kvserve's deployments rebind it to 127.0.0.1 (cluster/loopback.py)."""
    pytest.importorskip("ray")
    import ray.serve._private.replica as replica_module

    from kvserve.cluster import loopback

    seen: list[str] = []
    monkeypatch.setattr(replica_module, "add_port_to_grpc_server", lambda s, a: seen.append(a))
    monkeypatch.delenv(loopback.LOCAL_CLUSTER_ENV, raising=False)
    assert not loopback.bind_serve_grpc_to_loopback()  # a joined cluster: Ray's binding
    monkeypatch.setenv(loopback.LOCAL_CLUSTER_ENV, "1")
    assert loopback.bind_serve_grpc_to_loopback()
    assert loopback.bind_serve_grpc_to_loopback()  # idempotent: wrapped once
    replica_module.add_port_to_grpc_server(None, "[::]:0")
    assert seen == ["127.0.0.1:0"]


def test_min_healthy_replicas_is_checked() -> None:
    pytest.importorskip("ray")
    from kvserve.cluster.app import ClusterOptions

    with pytest.raises(ValueError, match="--min-healthy-replicas 3"):
        ClusterOptions(num_replicas=2, threads_per_replica=1, min_healthy_replicas=3)
    assert ClusterOptions(num_replicas=2, threads_per_replica=1, min_healthy_replicas=1)


def test_metrics_hub_drops_a_dead_replica_at_once() -> None:
    pytest.importorskip("ray")
    import asyncio
    from types import SimpleNamespace

    from ray.exceptions import RayActorError

    from kvserve.cluster.metrics_hub import MetricsHub

    def actor(alive: dict[str, bool]) -> object:
        async def ready() -> bool:
            if not alive["on"]:
                raise RayActorError()
            return True

        return SimpleNamespace(__ray_ready__=SimpleNamespace(remote=ready))

    a, b = {"on": True}, {"on": True}
    hub = MetricsHub(stale_after_s=60.0)
    hub.push("a", 1, "text a", actor(a))
    hub.push("b", 2, "text b", actor(b))
    assert set(asyncio.run(hub.snapshot())) == {"a", "b"}
    b["on"] = False  # killed: gone at the next snapshot, long before it is stale
    assert set(asyncio.run(hub.snapshot())) == {"a"}
    hub.push("b", 2, "late push from the dead replica", actor(b))
    assert set(asyncio.run(hub.snapshot())) == {"a"}


def test_a_replica_the_hub_drops_leaves_the_router_at_once() -> None:
    """The ingress's replica watch hands the replicas the hub stopped listing to the
    router, which leaves them out of its ranking (no call to them has to fail first);
    a replacement (new name) is routed to, and an all-excluded list falls back."""
    pytest.importorskip("ray.serve")
    import asyncio
    from types import SimpleNamespace

    from ray.exceptions import RayActorError

    from kvserve.cluster import router as router_module
    from kvserve.cluster import routing_state
    from kvserve.cluster.metrics_hub import MetricsHub
    from kvserve.cluster.remote_engine import RemoteEngine

    def actor(alive: dict[str, bool]) -> object:
        async def ready() -> bool:
            if not alive["on"]:
                raise RayActorError()
            return True

        return SimpleNamespace(__ray_ready__=SimpleNamespace(remote=ready))

    hub = MetricsHub(stale_after_s=60.0)
    hub_handle = SimpleNamespace(snapshot=SimpleNamespace(remote=hub.snapshot))
    engine = object.__new__(RemoteEngine)  # only the watch's state
    from kvserve.cluster.cluster_metrics import RouterMetrics

    engine._hub, engine.router_metrics = hub_handle, RouterMetrics()
    engine._seen_replicas, engine.num_live_replicas = set(), 0

    # As Ray ships it: the router's module pickled by value (its globals are copies).
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(router_module)
    try:
        shipped = cloudpickle.loads(cloudpickle.dumps(router_module.KVServeRequestRouter))
    finally:
        cloudpickle.unregister_pickle_by_value(router_module)
    router = object.__new__(shipped)
    router.initialize_state()

    def replica(name: str) -> object:
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats={})

    def ranked(names: list[str]) -> list[str]:
        ranks = asyncio.run(router.choose_replicas([replica(n) for n in names]))
        return [rank[0].replica_id.unique_id for rank in ranks]

    a, b = {"on": True}, {"on": True}
    hub.push("a", 1, "", actor(a))
    hub.push("b", 2, "", actor(b))
    try:
        asyncio.run(engine.snapshot_replicas())
        assert sorted(ranked(["a", "b"])) == ["a", "b"]
        b["on"] = False  # killed; Ray still offers it as a candidate
        asyncio.run(engine.snapshot_replicas())
        assert engine.num_live_replicas == 1
        before = routing_state.chosen_counts().get("b", 0)
        for _ in range(4):  # ties rotate: "b" would be first every other time
            assert ranked(["a", "b"]) == ["a"]
        assert routing_state.chosen_counts().get("b", 0) == before
        assert b"kvserve:router_excluded_replicas 1.0" in engine.router_metrics.render()
        hub.push("c", 3, "", actor({"on": True}))  # the replacement
        asyncio.run(engine.snapshot_replicas())
        assert sorted(ranked(["a", "b", "c"])) == ["a", "c"]
        assert ranked(["b"]) == ["b"]  # nothing else: Ray's failure handling decides
    finally:
        routing_state.exclude_replicas(frozenset())


def test_the_hub_lists_each_replica_s_facts_until_it_goes() -> None:
    pytest.importorskip("ray")
    import asyncio

    from kvserve.cluster.metrics_hub import MetricsHub

    hub = MetricsHub(stale_after_s=60.0)
    meta = {"started_at": 1.0, "startup_s": 2.5, "step_fit": "stored abc.json"}
    hub.push("a", 1, "text a", None, meta)
    hub.push("b", 2, "text b")  # no facts (yet)
    snap = asyncio.run(hub.snapshot())
    assert snap["a"]["meta"] == meta and snap["b"]["meta"] == {}
    hub._forget("a")
    assert set(asyncio.run(hub.snapshot())) == {"b"} and "a" not in hub._meta


def test_the_router_logic_forgets_a_replica_scaled_away() -> None:
    from kvserve.cluster.policy import RoutingConfig, RoutingLogic

    logic = RoutingLogic(RoutingConfig(policy="prefix-aware"))
    logic.choose(["a", "b"], [b"k1", b"k2"], request_id="r1")
    logic.choose(["a", "b"], [b"k3"], request_id="r2")
    assert logic.known_replicas() == {"a", "b"}
    logic.retain(["a"])  # Serve's new replica set: b is being drained
    assert logic.known_replicas() == {"a"}
    assert logic.in_flight("b") == 0 and logic.index.matched_blocks("b", [b"k1"]) == 0
