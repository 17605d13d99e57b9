"""Autoscaling end to end: ``kvserve serve --min-replicas 1 --max-replicas 2`` on a
local Ray cluster (127.0.0.1), short delays and look-back, a burst of streamed
requests scales it 1 -> 2 and a light load scales it back 2 -> 1
(``kvserve.bench.ramp``; ``benchmarks/autoscale_ramp.py`` is the same ramp as a
measurement).

Checked: no request fails or is cut (each streams its ``max_tokens`` whole); the
replica Serve removes was still finishing requests after the router dropped it (the
drain); the router holds state for the remaining replica only and ranks the removed
one first never again; the new replica took the step-time fit the first one stored
(``step_fit`` "stored <file>", no calibration of its own). The new replica's time to serve is printed (a figure, not a
bound: it depends on the machine's load).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.server_helpers import ServerProcess, cache_root_with_own, serve_process

pytest.importorskip("ray.serve", reason="the 'ray' extra is not installed")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(600),
    pytest.mark.xdist_group("ray-cluster"),
]

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "TOKENIZERS_PARALLELISM": "false"}
# target 3 ongoing requests per replica: the burst's 4 clients need 2 replicas
# (4 / 3 -> 2), the trickle's 2 clients one (2 / 3 -> 1)
RAMP_ARGS = [
    "--min-replicas", "1", "--max-replicas", "2", "--threads-per-replica", "1",
    "--target-ongoing-requests", "3", "--upscale-delay", "1", "--downscale-delay", "3",
    "--autoscale-look-back", "3", "--graceful-shutdown-timeout", "30",
    "--num-kv-blocks", "256", "--max-model-len", "512", "--no-access-log",
]  # fmt: skip


@pytest.fixture(scope="module")
def ramp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    tmp = tmp_path_factory.mktemp("ramp")
    # its own step-time fit store (the step-time budget is on): the first replica
    # calibrates and stores its fit here when steady, the new one finds it; the other
    # caches are the suite's (with an empty root each replica converted the model and
    # built the native kernels again)
    cache = cache_root_with_own(("step_cost",), tmp)
    env = {**RAY_ENV, "KVSERVE_CACHE_DIR": str(cache)}
    with serve_process(RAMP_ARGS, tmp, timeout_s=300.0, env_overrides=env) as server:
        yield server, cache


def test_ramp_scales_1_2_1_without_failures(ramp_cluster: tuple[ServerProcess, Path]) -> None:
    from kvserve.bench.ramp import run_ramp

    server, cache = ramp_cluster
    stored = sorted((cache / "step_cost").glob("*.json"))  # the first replica's, if steady
    result = run_ramp(
        server.base_url,
        burst_clients=4,
        burst_tokens=16,
        trickle_clients=2,
        trickle_tokens=64,
        burst_timeout_s=150,
        trickle_timeout_s=120,
    )
    summary = result.summary()
    print("ramp:", json.dumps(summary))
    assert result.new_served_s is not None, summary  # 1 -> 2, and the new one served
    assert result.removed_replica is not None and result.gone_s is not None, summary  # 2 -> 1
    assert result.failures == [], summary  # nothing failed or was cut, either way
    # the drain: Serve picks which replica to stop; when it still had requests they
    # ended whole (failures above), and an idle one has nothing to drain, so the
    # counts (summary["drained_running"/"drained_finished"]) are reported, not required
    survivor = ({result.first_replica, result.new_replica} - {result.removed_replica}).pop()
    assert result.router_after == [survivor], summary  # the router forgot it
    assert result.chosen_after_removal == 0, summary
    # the new replica warms from the stored step-time fit (a short check, no refit)
    first_fit, new_fit = result.first_meta.get("step_fit"), result.new_meta.get("step_fit")
    if stored:
        assert first_fit == "calibrated", summary
        assert new_fit == f"stored {stored[0].name}", summary
    else:  # the first fit's repeats disagreed (a busy machine): nothing to warm from
        assert not str(new_fit).startswith("stored"), summary  # nothing stored to take
        warnings.warn(
            "the first replica's step-time fit was not steady enough to store: the new "
            "replica's warm start from it was not exercised this run",
            stacklevel=1,
        )
