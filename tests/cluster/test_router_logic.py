"""The routing logic against a fake replica set: no ray, no model."""

from __future__ import annotations

import pytest

from kvserve.cluster.policy import (
    LEAST_LOADED,
    LOAD_OVER_PREFIX,
    NO_PREFIX,
    PREFIX_HIT,
    ReplicaReport,
    RoutingConfig,
    RoutingLogic,
)
from kvserve.cluster.prefix_index import PrefixIndex, block_key, pack_keys, unpack_keys
from kvserve.kv_cache.hashing import extend_block_hashes, request_extra_keys
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, SamplingParams

BS = 4
FP = "model-fp"


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def keys_for(tokens: list[int], salt: str | None = None) -> tuple[bytes, ...]:
    """The ingress's keys: the engine's chained hashes, cut to index keys."""
    hashes = extend_block_hashes([], tokens, BS, request_extra_keys(FP, None, salt))
    return tuple(block_key(h) for h in hashes)


def report(
    keys: set[bytes],
    seq: int,
    *,
    epoch: str = "e1",
    running: int = 0,
    waiting: int = 0,
    free: int = 1000,
) -> ReplicaReport:
    return ReplicaReport(epoch, seq, running, waiting, free, 1000, pack_keys(sorted(keys)))


PREFIX_A = list(range(1, 33))  # 8 blocks
PREFIX_B = list(range(100, 132))


def test_ingress_hashes_equal_the_engines_own() -> None:
    """The router's keys are the KV cache manager's block hashes, salt included."""
    manager = KVCacheManager(64, BS, 256, model_fingerprint=FP)
    for salt in (None, "tenant-a"):
        request = Request("r", PREFIX_A + [7, 8], SamplingParams(max_tokens=1), cache_salt=salt)
        manager.get_computed_blocks(request)  # the engine hashes the request
        assert tuple(block_key(h) for h in request.block_hashes) == keys_for(
            PREFIX_A + [7, 8], salt
        )
        assert len(request.block_hashes) == 8


def test_pack_roundtrip_and_ragged() -> None:
    keys = set(keys_for(PREFIX_A))
    assert unpack_keys(pack_keys(keys)) == keys
    with pytest.raises(ValueError, match="multiple of 8"):
        unpack_keys(b"abc")


def test_routing_decision_makes_the_next_request_follow() -> None:
    logic = RoutingLogic(RoutingConfig(queue_weight=0.0))
    keys = keys_for(PREFIX_A + [1, 2, 3, 4])
    first = logic.choose(["r1", "r2"], keys, request_id="q1")
    assert first.reason == NO_PREFIX and first.matched_blocks == 0
    second = logic.choose(["r1", "r2"], keys_for(PREFIX_A + [9, 9, 9, 9]), request_id="q2")
    assert second.replica == first.replica
    assert second.reason == PREFIX_HIT
    assert second.matched_blocks == 8 and second.num_blocks == 9
    assert second.matched_fraction == pytest.approx(8 / 9)


def test_pending_keys_expire_after_the_request_unless_a_report_confirms() -> None:
    clock = FakeClock()
    logic = RoutingLogic(RoutingConfig(queue_weight=0.0, pending_ttl_s=5.0), clock=clock)
    keys = keys_for(PREFIX_A)
    logic.choose(["r1"], keys, request_id="q1")
    assert logic.index.matched_blocks("r1", keys) == 8
    clock.t += 60  # still running: still held
    assert logic.index.matched_blocks("r1", keys) == 8
    logic.request_finished("q1")
    clock.t += 4
    assert logic.index.matched_blocks("r1", keys) == 8
    clock.t += 2  # past the ttl, and no report confirmed the blocks
    assert logic.index.matched_blocks("r1", keys) == 0
    logic.observe_report("r1", report(set(keys[:3]), seq=1))  # the replica holds 3 of them
    assert logic.index.matched_blocks("r1", keys) == 3


def test_eviction_reports_correct_the_index() -> None:
    logic = RoutingLogic(RoutingConfig(queue_weight=0.0))
    keys_a, keys_b = keys_for(PREFIX_A), keys_for(PREFIX_B)
    logic.observe_report("r1", report(set(keys_a), seq=1))
    logic.observe_report("r2", report(set(keys_b), seq=1))
    assert logic.choose(["r1", "r2"], keys_a).replica == "r1"
    # r1 evicted the tail of A (the engine evicts chain tails first) and cached B
    logic.observe_report("r1", report(set(keys_a[:2]) | set(keys_b), seq=2))
    assert logic.index.num_keys("r1") == 2 + len(keys_b)
    assert logic.index.matched_blocks("r1", keys_a) == 2
    # a stale report (lower seq) changes nothing
    logic.observe_report("r1", report(set(keys_a), seq=1))
    assert logic.index.matched_blocks("r1", keys_a) == 2
    # a restarted replica (new epoch) starts from what it reports
    logic.observe_report("r1", report(set(), seq=1, epoch="e2"))
    assert logic.index.matched_blocks("r1", keys_a) == 0
    assert logic.choose(["r1", "r2"], keys_b).replica == "r2"


def test_salt_isolation() -> None:
    """Two tenants with the same prompt share no key, so tenant B's request is not
    pulled to the replica holding tenant A's prefix."""
    logic = RoutingLogic(RoutingConfig(queue_weight=0.0))
    a = keys_for(PREFIX_A, "tenant-a")
    b = keys_for(PREFIX_A, "tenant-b")
    none = keys_for(PREFIX_A)
    assert not set(a) & set(b) and not set(a) & set(none)
    logic.observe_report("r1", report(set(a), seq=1))
    decision = logic.choose(["r1", "r2"], b)
    assert decision.reason == NO_PREFIX and decision.matched_blocks == 0
    assert logic.choose(["r1", "r2"], a).replica == "r1"


def test_load_penalty_spills_a_hot_prefix_then_both_hold_it() -> None:
    logic = RoutingLogic(RoutingConfig(queue_weight=0.1))
    keys = keys_for(PREFIX_A)  # fraction 1.0 matched on the holder
    logic.observe_report("r1", report(set(keys), seq=1))
    chosen = [logic.choose(["r1", "r2"], keys, request_id=f"q{i}") for i in range(12)]
    # up to 10 queued requests (10 * 0.1 = one full prefix) stay with r1 ...
    assert [d.replica for d in chosen[:10]] == ["r1"] * 10
    assert chosen[0].reason == PREFIX_HIT
    # ... then r1's queue outweighs the prefix: the request computes it on r2
    spill = chosen[10]
    assert spill.replica == "r2" and spill.reason == LOAD_OVER_PREFIX
    # r2 now (pending) holds it too: later requests split by load, both as hits
    assert chosen[11].reason == PREFIX_HIT
    assert logic.in_flight("r1") + logic.in_flight("r2") == 12


def test_a_multi_sample_request_weighs_its_samples_until_it_ends() -> None:
    """n=4 on one replica is 4 sequences of its queue (as its reports count them), and
    its end (or a retry moving it) takes all 4 back."""
    logic = RoutingLogic(RoutingConfig(policy="least-loaded"))
    logic.choose(["r1", "r2"], request_id="wide", num_seqs=4)
    wide_on = "r1" if logic.in_flight("r1") else "r2"
    other = "r2" if wide_on == "r1" else "r1"
    assert logic.in_flight(wide_on) == 4
    # three single requests go to the other replica: 1, 2, 3 < 4
    assert [logic.choose(["r1", "r2"], request_id=f"s{i}").replica for i in range(3)] == [other] * 3
    logic.choose([other], request_id="wide", num_seqs=4)  # a retry moved it
    assert logic.in_flight(wide_on) == 0 and logic.in_flight(other) == 7
    logic.request_finished("wide")
    assert logic.in_flight(other) == 3
    with pytest.raises(ValueError, match="num_seqs"):
        logic.choose(["r1"], num_seqs=0)


def test_reported_queue_and_kv_shortfall_penalise() -> None:
    logic = RoutingLogic(RoutingConfig(queue_weight=0.1, kv_weight=1.0))
    keys = keys_for(PREFIX_A)
    logic.observe_report("r1", report(set(keys), seq=1, running=4, waiting=20))
    logic.observe_report("r2", report(set(), seq=1))
    assert logic.queue_len("r1") == 24
    assert logic.choose(["r1", "r2"], keys).replica == "r2"  # 1.0 - 2.4 < 0
    # free KV blocks: a replica that cannot fit the request loses to one that can
    logic2 = RoutingLogic(RoutingConfig(queue_weight=0.0, kv_weight=1.0))
    logic2.observe_report("r1", report(set(keys[:4]), seq=1, free=0))
    logic2.observe_report("r2", report(set(), seq=1, free=100))
    d = logic2.choose(["r1", "r2"], keys, num_blocks_needed=9)
    assert d.replica == "r2" and d.reason == LOAD_OVER_PREFIX


def test_finished_requests_release_load() -> None:
    logic = RoutingLogic(RoutingConfig(policy="least-loaded"))
    d1 = logic.choose(["r1", "r2"], request_id="a")
    d2 = logic.choose(["r1", "r2"], request_id="b")
    assert {d1.replica, d2.replica} == {"r1", "r2"} and d1.reason == LEAST_LOADED
    logic.request_finished("a")
    assert logic.choose(["r1", "r2"]).replica == d1.replica
    logic.request_finished("unknown")  # ignored


def test_round_robin_cycles_and_dead_replicas_are_forgotten() -> None:
    logic = RoutingLogic(RoutingConfig(policy="round-robin"))
    seen = [logic.choose(["a", "b", "c"]).replica for _ in range(6)]
    assert seen[:3] == ["a", "b", "c"] and seen[3:] == seen[:3]
    logic.observe_report("a", report(set(keys_for(PREFIX_A)), seq=1))
    logic.retain(["b", "c"])
    assert logic.index.replicas == [] or "a" not in logic.index.replicas
    with pytest.raises(ValueError, match="no running replica"):
        logic.choose([])


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="prefix-aware"):
        RoutingConfig(policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="queue_weight"):
        RoutingConfig(queue_weight=-1)
    with pytest.raises(ValueError, match="pending_ttl_s"):
        PrefixIndex(pending_ttl_s=-1)


def test_report_roundtrip_through_routing_stats() -> None:
    r = report({b"12345678"}, seq=3, running=1, waiting=2, free=7)
    assert ReplicaReport.from_stats(r.to_stats()) == r
    assert ReplicaReport.from_stats({}) is None and ReplicaReport.from_stats(None) is None


def test_new_prefixes_go_where_fewer_blocks_are_cached() -> None:
    logic = RoutingLogic(RoutingConfig())
    logic.observe_report("r1", report(set(keys_for(PREFIX_A)), seq=1))
    logic.observe_report("r2", report(set(), seq=1))
    for _ in range(3):  # whatever the rotation, equal queues: the emptier cache wins
        d = logic.choose(["r1", "r2"], keys_for(list(range(500, 532))))
        assert d.reason == NO_PREFIX and d.replica == "r2"


def _routed_hit_rate(policy: str) -> float:
    """4 shared prefixes x 8 requests, seeded order, routed over two replicas whose KV
    caches are the engine's own managers (each request computed and freed in turn):
    the prefix-cache hit rate over all prompt tokens."""
    import random

    rng = random.Random(1)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(96)] for _ in range(4)]
    order = [p for p in range(4) for _ in range(8)]
    rng.shuffle(order)
    managers = {r: KVCacheManager(512, BS, 512, model_fingerprint=FP) for r in ("r1", "r2")}
    logic = RoutingLogic(RoutingConfig(policy=policy, queue_weight=0.0))
    hits = total = 0
    for i, p in enumerate(order):
        tokens = prefixes[p] + [rng.randrange(1000, 40000) for _ in range(3)]
        decision = logic.choose(["r1", "r2"], keys_for(tokens), request_id=f"q{i}")
        kv = managers[decision.replica]
        request = Request(f"q{i}", tokens, SamplingParams(max_tokens=1))
        blocks, cached = kv.get_computed_blocks(request)
        assert kv.allocate_slots(request, len(tokens) - cached, blocks, cached) is not None
        kv.cache_blocks(request, len(tokens))
        kv.free(request)
        logic.request_finished(f"q{i}")
        hits, total = hits + cached, total + len(tokens)
    return hits / total


def test_prefix_aware_routing_beats_round_robin_on_the_engines_caches() -> None:
    """What ``kvserve serve --replicas 2 --routing ...`` does with a shared-prefix
    workload, without Ray: prefix-aware sends each prefix to the replica holding it
    (one miss per prefix), round-robin computes each prefix on both replicas."""
    aware, rr = _routed_hit_rate("prefix-aware"), _routed_hit_rate("round-robin")
    assert aware == pytest.approx(7 * 96 / (8 * 99))  # one cold request per prefix
    assert rr < aware - 0.05
