"""--min-replicas / --max-replicas: the mapping onto Ray Serve's autoscaling_config and
the startup errors for bad combinations (no Ray cluster started)."""

from __future__ import annotations

import pytest

from kvserve.cluster.autoscaling import (
    RAY_DOWNSCALE_DELAY_S,
    RAY_UPSCALE_DELAY_S,
    Autoscaling,
    autoscaling_from_flags,
)


def _flags(**kw: object) -> Autoscaling | None:
    base: dict[str, object] = {
        "replicas": None,
        "min_replicas": None,
        "max_replicas": None,
        "target_ongoing_requests": None,
        "upscale_delay_s": None,
        "downscale_delay_s": None,
        "look_back_s": None,
        "target_kv_usage": None,
        "max_num_seqs": 16,
    }
    base.update(kw)
    return autoscaling_from_flags(**base)  # type: ignore[arg-type]


def test_no_flags_is_a_fixed_size() -> None:
    assert _flags(replicas=3) is None


def test_mapping_onto_ray_fields_and_defaults() -> None:
    scaling = _flags(min_replicas=1, max_replicas=3)
    assert scaling is not None
    assert scaling.to_ray() == {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": 3,
        "target_ongoing_requests": 16.0,  # the engine's max_num_seqs
        "upscale_delay_s": RAY_UPSCALE_DELAY_S,
        "downscale_delay_s": RAY_DOWNSCALE_DELAY_S,
        "look_back_period_s": 30.0,  # Ray's defaults
        "metrics_interval_s": 10.0,
        "policy": {
            "policy_function": "kvserve.cluster.scaling_policy:EnginePressurePolicy",
            "policy_kwargs": {"max_num_seqs": 16, "target_kv_usage": 0.8},
        },
    }
    tuned = _flags(
        replicas=2,
        min_replicas=1,
        max_replicas=4,
        target_ongoing_requests=2.5,
        upscale_delay_s=1,
        downscale_delay_s=0,
        look_back_s=3,
        target_kv_usage=0.5,
    )
    assert tuned is not None
    assert tuned.to_ray() == {
        "min_replicas": 1,
        "initial_replicas": 2,
        "max_replicas": 4,
        "target_ongoing_requests": 2.5,
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 0.0,
        "look_back_period_s": 3.0,
        "metrics_interval_s": 1.0,  # three reports per window
        "policy": {
            "policy_function": "kvserve.cluster.scaling_policy:EnginePressurePolicy",
            "policy_kwargs": {"max_num_seqs": 16, "target_kv_usage": 0.5},
        },
    }


def test_ray_accepts_the_mapping() -> None:
    config = pytest.importorskip("ray.serve.config")
    scaling = _flags(replicas=2, min_replicas=1, max_replicas=3, target_ongoing_requests=1)
    assert scaling is not None
    parsed = config.AutoscalingConfig(**scaling.to_ray())
    assert (parsed.min_replicas, parsed.initial_replicas, parsed.max_replicas) == (1, 2, 3)
    assert parsed.target_ongoing_requests == 1.0
    assert (parsed.look_back_period_s, parsed.metrics_interval_s) == (30.0, 10.0)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"min_replicas": 3, "max_replicas": 2}, "--min-replicas <= --max-replicas"),
        ({"min_replicas": 0, "max_replicas": 2}, "invalid --min-replicas 0"),
        ({"min_replicas": 1, "max_replicas": 1}, "invalid --max-replicas 1"),
        ({"min_replicas": 1}, "add --max-replicas"),
        ({"max_replicas": 3}, "add --min-replicas"),
        ({"replicas": 5, "min_replicas": 1, "max_replicas": 3}, "must lie in [1, 3]"),
        ({"target_ongoing_requests": 2.0}, "add --min-replicas M --max-replicas X"),
        ({"replicas": 2, "upscale_delay_s": 1.0}, "--upscale-delay only tune autoscaling"),
        (
            {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 0.0},
            "invalid --target-ongoing-requests",
        ),
        (
            {"min_replicas": 1, "max_replicas": 2, "downscale_delay_s": -1.0},
            "invalid --downscale-delay",
        ),
        (
            {"min_replicas": 1, "max_replicas": 2, "look_back_s": 0.0},
            "invalid --autoscale-look-back",
        ),
        ({"look_back_s": 3.0}, "--autoscale-look-back only tune autoscaling"),
        (
            {"min_replicas": 1, "max_replicas": 2, "target_kv_usage": 1.2},
            "invalid --target-kv-usage 1.2",
        ),
        (
            {"min_replicas": 1, "max_replicas": 2, "disaggregated": True},
            "cannot be combined with --prefill-replicas",
        ),
    ],
)
def test_bad_combinations_say_the_fix(kw: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError) as err:
        _flags(**kw)
    assert says in str(err.value)


def test_cluster_options_take_autoscaling() -> None:
    pytest.importorskip("ray.serve")
    from kvserve.cluster.app import ClusterOptions

    scaling = _flags(min_replicas=1, max_replicas=2, target_ongoing_requests=1)
    assert scaling is not None
    opts = ClusterOptions(
        num_replicas=None,
        threads_per_replica=1,
        autoscaling=scaling,
        graceful_shutdown_timeout_s=30.0,
    )
    assert opts.start_replicas == 1 and opts.healthy_floor == 1
    assert opts.scaling_options() == {"autoscaling_config": scaling.to_ray()}
    fixed = ClusterOptions(num_replicas=2, threads_per_replica=1)
    assert fixed.scaling_options() == {"num_replicas": 2}
    with pytest.raises(ValueError, match="exclusive"):
        ClusterOptions(num_replicas=2, threads_per_replica=1, autoscaling=scaling)
    with pytest.raises(ValueError, match="with autoscaling use 1 to --min-replicas"):
        ClusterOptions(
            num_replicas=None, threads_per_replica=1, autoscaling=scaling, min_healthy_replicas=2
        )
    with pytest.raises(ValueError, match="--graceful-shutdown-timeout"):
        ClusterOptions(
            num_replicas=None,
            threads_per_replica=1,
            autoscaling=scaling,
            graceful_shutdown_timeout_s=-1.0,
        )


def test_serve_exits_2_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI path: a bad combination is refused before Ray starts."""
    import argparse

    from kvserve.entrypoints.serve_args import add_arguments
    from kvserve.entrypoints.serve_replicas import run_replicas

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--min-replicas", "3", "--max-replicas", "2"])
    assert run_replicas(args, None) == 2
    assert "--min-replicas <= --max-replicas" in capsys.readouterr().err
    args = parser.parse_args(
        ["--min-replicas", "1", "--max-replicas", "2", "--decode-replicas", "1"]
    )
    assert run_replicas(args, None) == 2
    assert "cannot be combined with --prefill-replicas" in capsys.readouterr().err
