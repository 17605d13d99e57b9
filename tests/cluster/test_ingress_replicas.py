"""--ingress-replicas K: the options' checks, the CLI's refusals, and how the routers'
series of several ingresses are merged in ``/metrics`` (no Ray cluster started; the
two-ingress cluster itself runs in tests/cluster/test_cluster_e2e.py)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.cluster.cluster_metrics import RouterMetrics, label_texts
from kvserve.cluster.metrics_hub import MetricsHub
from kvserve.cluster.policy import Decision


def _parser() -> argparse.ArgumentParser:
    from kvserve.entrypoints.serve_args import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_options_bound_the_ingress_count_and_refuse_a_default_seed() -> None:
    pytest.importorskip("ray.serve")
    from kvserve.cluster.app import MAX_INGRESS_REPLICAS, ClusterOptions

    ok = ClusterOptions(num_replicas=2, threads_per_replica=1, ingress_replicas=3)
    assert ok.ingress_replicas == 3
    for bad in (0, -1, MAX_INGRESS_REPLICAS + 1, 1.5):
        with pytest.raises(ValueError, match="invalid --ingress-replicas"):
            ClusterOptions(num_replicas=2, threads_per_replica=1, ingress_replicas=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--seed cannot be combined with --ingress-replicas"):
        ClusterOptions(
            num_replicas=2,
            threads_per_replica=1,
            ingress_replicas=2,
            http_options={"default_seed": 7},
        )
    # one ingress keeps --seed (it seeds in arrival order, as one server does)
    ClusterOptions(num_replicas=2, threads_per_replica=1, http_options={"default_seed": 7})


def test_cli_refuses_ingress_replicas_without_a_cluster_and_with_a_seed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("ray.serve")
    from kvserve.entrypoints.serve_cmd import run
    from kvserve.entrypoints.serve_replicas import run_replicas

    parser = _parser()
    assert run(parser.parse_args(["--ingress-replicas", "2"])) == 2
    assert "--ingress-replicas needs --replicas N" in capsys.readouterr().err
    args = parser.parse_args(["--replicas", "2", "--ingress-replicas", "2", "--seed", "1"])
    assert run_replicas(args, None) == 2
    assert "--seed cannot be combined with --ingress-replicas" in capsys.readouterr().err
    args = parser.parse_args(["--replicas", "2", "--ingress-replicas", "0"])
    assert run_replicas(args, None) == 2
    assert "invalid --ingress-replicas 0" in capsys.readouterr().err


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_each_ingress_router_series_keep_their_own_label() -> None:
    a, b = RouterMetrics(), RouterMetrics()
    a.observe(Decision("r1", "prefix-aware", "prefix_hit", 3, 4, ("r1", "r2")))
    a.observe(Decision("r1", "prefix-aware", "prefix_hit", 4, 4, ("r1", "r2")))
    b.observe(Decision("r2", "prefix-aware", "least_loaded", 0, 4, ("r2", "r1")))
    b.sync_chosen({"r2": 5})
    merged = label_texts({"i1": a.render().decode(), "i2": b.render().decode()}, "ingress")
    values = _samples(merged.decode())
    hit = (("ingress", "i1"), ("policy", "prefix-aware"), ("reason", "prefix_hit"))
    assert values[("kvserve:router_decisions_total", hit)] == 2.0
    other = (("ingress", "i2"), ("policy", "prefix-aware"), ("reason", "least_loaded"))
    assert values[("kvserve:router_decisions_total", other)] == 1.0
    assert values[("kvserve:router_chosen_total", (("ingress", "i2"), ("replica", "r2")))] == 5.0
    assert values[("kvserve:router_matched_prefix_fraction_count", (("ingress", "i1"),))] == 2.0
    # one HELP/TYPE per family, whatever the number of ingresses
    assert merged.decode().count("# TYPE kvserve:router_decisions_total counter") == 1
    with pytest.raises(ValueError, match="ingress i3"):
        label_texts({"i3": "not { prometheus"}, "ingress")


def test_hub_keeps_each_ingress_latest_text_until_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvserve.cluster.metrics_hub as hub_module

    now = [100.0]

    class _Clock:
        @staticmethod
        def monotonic() -> float:
            return now[0]

    monkeypatch.setattr(hub_module, "time", _Clock)
    hub = MetricsHub(stale_after_s=10.0)
    hub.push_ingress("i1", "old")
    hub.push_ingress("i1", "new")
    now[0] = 105.0
    hub.push_ingress("i2", "other")
    assert hub.ingress_texts() == {"i1": "new", "i2": "other"}
    now[0] = 111.0  # i1 last pushed 11 s ago: gone (scaled away or dead)
    assert hub.ingress_texts() == {"i2": "other"}


def test_remote_engine_renders_every_ingress_and_survives_a_failed_push() -> None:
    """``render_metrics`` pushes this ingress's series and merges the others' from the
    hub; the replica watch keeps counting replicas when a push fails."""
    from kvserve.cluster.remote_engine import RemoteEngine

    class _Remote:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        async def remote(self, *a: Any) -> Any:
            return self.fn(*a)

    class _Hub:
        def __init__(self) -> None:
            self.texts: dict[str, str] = {}
            self.fail_push = False
            self.snapshot = _Remote(lambda: {"rep1": {"pid": 1, "age_s": 0.1, "text": ""}})
            self.push_ingress = _Remote(self._push)
            self.ingress_texts = _Remote(lambda: dict(self.texts))

        def _push(self, name: str, text: str) -> None:
            if self.fail_push:
                raise RuntimeError("hub restarting")
            self.texts[name] = text

    other = RouterMetrics()
    other.observe(Decision("rep1", "prefix-aware", "prefix_hit", 1, 1, ("rep1",)))
    hub = _Hub()
    hub.texts["ingress-b"] = other.render().decode()
    engine = RemoteEngine.__new__(RemoteEngine)  # only the metrics side is exercised
    engine._hub = hub
    engine.ingress_id = "ingress-a"
    engine.router_metrics = RouterMetrics()
    engine._seen_replicas = set()
    engine.router_metrics.observe(Decision("rep1", "prefix-aware", "least_loaded", 0, 1, ("rep1",)))
    values = _samples(asyncio.run(engine.render_metrics()).decode())
    mine = (("ingress", "ingress-a"), ("policy", "prefix-aware"), ("reason", "least_loaded"))
    theirs = (("ingress", "ingress-b"), ("policy", "prefix-aware"), ("reason", "prefix_hit"))
    assert values[("kvserve:router_decisions_total", mine)] == 1.0
    assert values[("kvserve:router_decisions_total", theirs)] == 1.0
    assert "ingress-a" in hub.texts  # pushed for the other ingresses

    async def one_watch() -> None:
        task = asyncio.create_task(engine.watch_replicas(period_s=0.01))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    hub.fail_push = True
    engine.num_live_replicas = 0
    asyncio.run(one_watch())
    assert engine.num_live_replicas == 1  # a failed push does not mark replicas dead


def test_two_routers_send_a_new_prefix_to_the_same_replica() -> None:
    """Two ingresses' routers that have seen nothing of each other: the second request
    of a prefix goes where the first went (the rendezvous tie-break), and different
    prefixes still spread over the replicas."""
    import hashlib

    from kvserve.cluster.policy import RoutingConfig, RoutingLogic

    replicas = ["rep-a", "rep-b", "rep-c"]
    first = RoutingLogic(RoutingConfig(policy="prefix-aware"))
    second = RoutingLogic(RoutingConfig(policy="prefix-aware"))
    chosen = []
    for p in range(24):
        keys = [hashlib.sha256(f"prefix {p} block {b}".encode()).digest()[:16] for b in range(4)]
        a = first.choose(replicas, keys, request_id=f"a{p}")
        first.request_finished(f"a{p}")
        second.choose(replicas, [], request_id=f"other{p}")  # unrelated short traffic
        second.request_finished(f"other{p}")
        b = second.choose(replicas, keys, request_id=f"b{p}")
        second.request_finished(f"b{p}")
        assert b.replica == a.replica, p
        chosen.append(a.replica)
    assert len(set(chosen)) == len(replicas)  # new prefixes are not all on one replica


def test_with_several_routers_a_new_prefix_ignores_small_load_differences() -> None:
    """Two routers whose views of the loads differ (one still counts a finished stream,
    the other has pending keys of its own): with ``routers=2`` both send a new prefix
    to its rendezvous replica while loads stay near the mean, and a skewed replica
    (over the bound) is skipped."""
    import hashlib

    from kvserve.cluster.policy import NO_PREFIX, ReplicaReport, RoutingConfig, RoutingLogic

    replicas = ["rep-a", "rep-b"]
    keys = [hashlib.sha256(f"salted prefix block {b}".encode()).digest()[:16] for b in range(18)]
    home = RoutingLogic(RoutingConfig(routers=2)).choose(replicas, keys).replica
    other = next(r for r in replicas if r != home)

    def stale(running: int) -> ReplicaReport:
        return ReplicaReport(
            epoch="e",
            seq=1,
            num_running=running,
            num_waiting=0,
            num_free_blocks=1000,
            num_blocks=1000,
        )

    seen_busy = RoutingLogic(RoutingConfig(routers=2))
    seen_busy.observe_report(home, stale(1))  # a stream that ended since
    footprint = RoutingLogic(RoutingConfig(routers=2))
    unrelated = [hashlib.sha256(f"u{b}".encode()).digest()[:16] for b in range(30)]
    footprint.choose([home], unrelated, request_id="u")  # pending keys on home
    footprint.request_finished("u")
    for logic in (seen_busy, footprint):
        d = logic.choose(replicas, keys)
        assert d.replica == home and d.reason == NO_PREFIX
    # one router alone keeps the load and footprint tie-breaks
    single = RoutingLogic(RoutingConfig())
    single.observe_report(home, stale(1))
    assert single.choose(replicas, keys).replica == other
    # a home replica far over the mean load is passed over
    skewed = RoutingLogic(RoutingConfig(routers=2))
    skewed.observe_report(home, stale(6))
    assert skewed.choose(replicas, keys).replica == other
    with pytest.raises(ValueError, match="routers"):
        RoutingConfig(routers=0)


def test_only_engine_replicas_keep_serves_shutdown_wait() -> None:
    """The hub and the ingresses (removed only when the application stops) wait 0.2 s
    before stopping, not Serve's 2 s; engine replicas, which autoscaling removes while
    requests may still be routed to them, keep Serve's wait and the drain timeout."""
    pytest.importorskip("ray.serve")
    from kvserve.cluster.app import ClusterOptions, build_application

    app = build_application(ClusterOptions(num_replicas=2, threads_per_replica=1))
    ingress = app._bound_deployment
    bound = {ingress.name: ingress}
    for arg in [*ingress.init_args, *ingress.init_kwargs.values()]:
        dep = getattr(arg, "_bound_deployment", None)
        if dep is not None:
            bound[dep.name] = dep
    assert set(bound) == {"KVServeIngress", "EngineReplica", "MetricsHub"}
    waits = {n: d._deployment_config.graceful_shutdown_wait_loop_s for n, d in bound.items()}
    assert waits == {"KVServeIngress": 0.2, "MetricsHub": 0.2, "EngineReplica": 2.0}
    assert bound["EngineReplica"]._deployment_config.graceful_shutdown_timeout_s == 30.0


def test_stop_deletes_the_app_before_serve_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM's stop deletes the app first (its replicas drain and stop), then shuts
    Serve down and disconnects: ``serve.shutdown`` alone left the controller waiting
    out its 30 s timeout ("Controller failed to shut down within 30.0s"), so every stop
    of ``kvserve serve --replicas 2`` took 38 s here, 8 s with the delete first."""
    pytest.importorskip("ray.serve")
    import ray
    from ray import serve

    from kvserve.cluster.app import APP_NAME
    from kvserve.cluster.launcher import stop_app

    calls: list[str] = []
    monkeypatch.setattr(serve, "delete", lambda name, *a, **k: calls.append(f"delete {name}"))
    monkeypatch.setattr(serve, "shutdown", lambda *a, **k: calls.append("serve.shutdown"))
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: calls.append("ray.shutdown"))
    stop_app()
    assert calls == [f"delete {APP_NAME}", "serve.shutdown", "ray.shutdown"]

    def failing_delete(name: str, *a: Any, **k: Any) -> None:
        calls.append("delete failed")
        raise RuntimeError("controller gone")

    calls.clear()
    monkeypatch.setattr(serve, "delete", failing_delete)
    with pytest.raises(RuntimeError):
        stop_app()
    assert calls == ["delete failed", "ray.shutdown"]  # still disconnects
