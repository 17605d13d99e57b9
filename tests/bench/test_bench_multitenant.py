"""The multi-tenant workload (Zipf popularity over shared prefixes) and the routing preset."""

from __future__ import annotations

from collections import Counter

import pytest

from kvserve.bench.presets import PRESETS
from kvserve.bench.workloads import WorkloadSpec, build_workload


def test_zipf_popularity_and_determinism() -> None:
    spec = WorkloadSpec(
        kind="multi-tenant", num_requests=2000, prefix_len=8, num_prefixes=10, input_len=4,
        output_len=2, zipf_s=1.0,
    )  # fmt: skip
    w = build_workload(spec)
    assert w == build_workload(spec)
    counts = Counter(s.prefix_group for s in w.sessions)
    # weight 1/(k+1): tenant 0 about twice tenant 1 and ten times tenant 9
    assert counts[0] > counts[1] > counts[4] > counts[9] > 0
    assert 1.5 < counts[0] / counts[1] < 2.6
    by_group = {s.prefix_group: s.system_text for s in w.sessions}
    assert len(set(by_group.values())) == 10  # one shared prefix per tenant
    flat = build_workload(WorkloadSpec(**{**spec.__dict__, "zipf_s": 0.0}))
    flat_counts = Counter(s.prefix_group for s in flat.sessions)
    assert max(flat_counts.values()) < 2 * min(flat_counts.values())


def test_zipf_s_validation() -> None:
    with pytest.raises(ValueError, match="zipf_s"):
        build_workload(WorkloadSpec(kind="multi-tenant", zipf_s=-1.0))


def test_routing_preset_compares_three_policies_on_replicas() -> None:
    preset = PRESETS["routing"]
    assert [v.name for v in preset.variants] == ["round-robin", "least-loaded", "prefix-aware"]
    for v in preset.variants:
        assert "--replicas" in v.engine_args and v.name in v.engine_args
    assert preset.workload.kind == "multi-tenant" and preset.request_rate < float("inf")
    assert preset.target is not None and preset.target.figure == "mean_ttft_ms"
    assert [t.figure for t in preset.more_targets] == ["prefix_cache_hit_rate"]


def test_every_target_is_checked_and_printed() -> None:
    from kvserve.bench.compare import format_result

    preset = PRESETS["routing"]
    values = {
        "round-robin": {"mean_ttft_ms": 1000.0, "prefix_cache_hit_rate": 0.4},
        "prefix-aware": {"mean_ttft_ms": 400.0, "prefix_cache_hit_rate": 0.5},
    }
    assert preset.target is not None
    assert preset.target.check(values) == (0.4, True)
    assert preset.more_targets[0].check(values) == (1.25, False)
    result = {
        "preset": "routing",
        "description": "d",
        "table": "t",
        "target": {"claim": preset.target.describe(), "ratio": 0.4, "met": True},
        "more_targets": [{"claim": preset.more_targets[0].describe(), "ratio": 1.25, "met": False}],
        "errors": {},
    }
    text = format_result(result)
    assert "ratio 0.400 -> MET" in text and "ratio 1.250 -> NOT MET" in text
