"""kvserve's autoscaling policy (``cluster/scaling_policy.py``): the rule on plain
numbers, the policy on a real Ray ``AutoscalingContext`` after Ray's own
serialization of it, and the replica's reported metrics feeding it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvserve.cluster.scaling_policy import KV_USAGE, WAITING, EnginePressurePolicy

POLICY = EnginePressurePolicy(max_num_seqs=8, target_kv_usage=0.8)


def test_ongoing_alone_is_ray_s_rule() -> None:
    desired, terms = POLICY.desired(
        2, ongoing=9.0, target_ongoing=3.0, waiting=[0, 0], kv_usage=[0.1, 0.1]
    )
    assert desired == pytest.approx(3.0) and terms["ongoing"] == pytest.approx(3.0)
    assert terms["waiting"] == 0.0  # nothing waits: no say


def test_kv_usage_holds_or_adds_replicas() -> None:
    # one replica 96% full with few requests: 0.96 / 0.8 -> 1.2 -> Ray rounds up to 2
    desired, terms = POLICY.desired(
        1, ongoing=2.0, target_ongoing=8.0, waiting=[0], kv_usage=[0.96]
    )
    assert desired == pytest.approx(1.2) and terms["kv"] == pytest.approx(1.2)
    # two replicas half full: one could not hold both (1.0 / 0.8 = 1.25 -> 2 stay)
    desired, _ = POLICY.desired(
        2, ongoing=2.0, target_ongoing=8.0, waiting=[0, 0], kv_usage=[0.5, 0.5]
    )
    assert desired == pytest.approx(1.25)
    # idle: every term below 1, Ray's min decides
    desired, _ = POLICY.desired(
        2, ongoing=0.0, target_ongoing=8.0, waiting=[0, 0], kv_usage=[0.0, 0.0]
    )
    assert desired == 0.0


def test_waiting_requests_ask_for_one_more_replica_per_batch() -> None:
    # 3 ongoing per replica, under the target of 8, but requests wait (KV-bound)
    desired, terms = POLICY.desired(
        2, ongoing=6.0, target_ongoing=8.0, waiting=[1.5, 0.5], kv_usage=[0.3, 0.3]
    )
    assert desired == pytest.approx(2 + 2 / 8) and terms["ongoing"] < 1  # -> 3 replicas
    desired, _ = POLICY.desired(
        2, ongoing=6.0, target_ongoing=8.0, waiting=[0.4, 0.2], kv_usage=[0, 0]
    )
    assert desired < 1  # under one request waiting on average: noise, no say


def test_bad_values_are_ignored_or_refused() -> None:
    desired, _ = POLICY.desired(
        1, ongoing=float("nan"), target_ongoing=1.0, waiting=[-3.0], kv_usage=[float("inf")]
    )
    assert desired == 0.0
    with pytest.raises(ValueError, match="--target-kv-usage"):
        EnginePressurePolicy(8, 0.0)
    with pytest.raises(ValueError, match="--target-kv-usage"):
        EnginePressurePolicy(8, 1.5)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EnginePressurePolicy(0)


def test_ray_runs_the_policy_from_the_autoscaling_config() -> None:
    """The config kvserve hands Ray: Ray serializes the policy class, builds it with
    the kwargs, wraps it (delays, bounds) and calls it on a real context whose
    metrics come from running replicas only."""
    config_mod = pytest.importorskip("ray.serve.config")
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve._private.common import DeploymentID, ReplicaID

    from kvserve.cluster.autoscaling import autoscaling_from_flags

    scaling = autoscaling_from_flags(
        replicas=None, min_replicas=1, max_replicas=4, target_ongoing_requests=8.0,
        upscale_delay_s=0.0, downscale_delay_s=0.0, max_num_seqs=8, target_kv_usage=0.5,
    )  # fmt: skip
    assert scaling is not None
    config = config_mod.AutoscalingConfig(**scaling.to_ray())
    policy: Any = _resolve_policy_callable(config.policy)
    assert type(policy).__name__ == "EnginePressurePolicy" and policy.target_kv_usage == 0.5
    dep = DeploymentID(name="EngineReplica", app_name="kvserve")
    a, b, gone = (ReplicaID(unique_id=u, deployment_id=dep) for u in ("a", "b", "gone"))
    ctx = config_mod.AutoscalingContext(
        deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name,
        current_num_replicas=2, target_num_replicas=2, running_replicas=[a, b],
        total_num_requests=4.0, total_queued_requests=0.0,
        aggregated_metrics={KV_USAGE: {a: 0.9, b: 0.7, gone: 1.0}, WAITING: {a: 0.0, b: 0.0}},
        raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=0.0, config=config,
    )  # fmt: skip
    desired, state = policy(ctx)
    assert desired == pytest.approx((0.9 + 0.7) / 0.5)  # the replica gone is not counted
    assert state["kvserve_terms"]["ongoing"] == pytest.approx(0.5)


def test_the_replica_reports_waiting_and_kv_usage() -> None:
    from kvserve.cluster.replica import EngineReplica

    replica: Any = object.__new__(EngineReplica)
    stats = SimpleNamespace(num_reclaimable_blocks=30, num_empty_blocks=10)
    replica.async_engine = SimpleNamespace(stats=lambda: stats, num_waiting=lambda: 3)
    replica.engine = SimpleNamespace(kv_cache_manager=SimpleNamespace(num_blocks=101))
    assert replica.record_autoscaling_stats() == {WAITING: 3.0, KV_USAGE: pytest.approx(0.6)}
