"""Steady startup fits: medians over repeats, the persisted fit and when it is reused.

A fake runner whose steps last what a known cost model says (on a fake clock), so the
timings are exact and a noisy step can be injected where wanted.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from kvserve.config import SchedulerConfig
from kvserve.sched.cost_model import CostModel, output_features
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.worker import step_cost, step_cost_store
from kvserve.worker.step_cost import calibrate, persisted_calibration

CHECK_CALLS = 3 * (1 + step_cost.CHECK_TIMED_RUNS)  # the reuse check: 3 kinds, warmed then timed

TRUTH = (4.0, 0.5, 2.5e-4, 7e-4, 0.1)  # about the quiet bf16 startup fit of this machine


class ClockRunner:
    """``execute_model`` advances ``now`` (seconds) by ``TRUTH``'s time of the step,
    times ``slow`` and times ``spikes[call]`` for the calls listed there."""

    def __init__(self, **fingerprint: Any) -> None:
        self.now = 0.0
        self.slow = 1.0
        self.spikes: dict[int, float] = {}
        self.calls = 0
        self.block_size = 16
        self.num_kv_blocks = 4096
        self.kv_segment_size = 512
        self.device = "cpu"
        self.kv_format = SimpleNamespace(name="auto")
        self.attention_backend = "native"
        self.kernels = SimpleNamespace(library=None)
        self.compiled = None
        self.scheduler_config = SchedulerConfig()
        self.loaded = SimpleNamespace(
            fingerprint=fingerprint.get("model", "model-a"),
            dtype=fingerprint.get("dtype", "torch.bfloat16"),
        )

    def clock(self) -> float:
        return self.now

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {r: [1] for r in so.num_scheduled_tokens}
        if so.num_scheduled_tokens:
            f = output_features(so.num_scheduled_tokens, so.cached_seq_len, sampled)
            ms = CostModel(TRUTH).predict_ms(f) * self.slow * self.spikes.get(self.calls, 1.0)
            self.now += ms / 1e3
            self.calls += 1
        return ModelRunnerOutput(sampled_token_ids=sampled)


def _fit(runner: ClockRunner, **kw: Any) -> CostModel:
    return calibrate(runner, vocab_size=1000, max_model_len=4096, timer=runner.clock, **kw)  # type: ignore[arg-type]


def _decisions(model: CostModel) -> tuple[int, bool]:
    """What the scheduler would do beside 10 decodes at 1,100 tokens (300 / 90 ms):
    prompt tokens of a long prompt at context 1,024, and whether 64@1024 is short."""
    b = model.budget(300.0, 90.0)
    for _ in range(10):
        b.add(1, 1100, True)
    return b.prompt_tokens(1024, 2048), b.is_short(1024, 64)


def test_a_noisy_step_does_not_move_the_fit():
    quiet = _fit(ClockRunner())
    assert quiet.source == "calibrated" and quiet.spread == pytest.approx(1.0)
    for got, want in zip(quiet.coef, TRUTH, strict=True):
        assert got == pytest.approx(want, rel=1e-3)
    # another process takes the cores during one step of the 64@2560 prefill shape
    # (call 6: the 3 warm-up steps, then the shapes in order) and one decode step later
    noisy = ClockRunner()
    noisy.spikes = {6: 3.0, 3 + 10 + 7: 3.0}
    fit = _fit(noisy)
    for got, want in zip(fit.coef, TRUTH, strict=True):
        assert got == pytest.approx(want, rel=1e-3, abs=1e-9)
    assert _decisions(fit) == _decisions(quiet)
    assert fit.spread == pytest.approx(1.0)  # median over shapes: 2 of 10 spread
    # one timed repeat (the old rule without medians) would take the spike as the truth
    single = ClockRunner()
    single.spikes = {6: 3.0}
    alone = _fit(single, repeats=1)
    assert alone.coef[2] > 1.5 * TRUTH[2]
    assert _decisions(alone)[0] < 0.9 * _decisions(quiet)[0]


def test_the_warm_up_steps_are_not_fitted():
    runner = ClockRunner()
    runner.spikes = {0: 20.0, 1: 20.0, 2: 20.0}  # first step of each kind: allocations
    fit = _fit(runner)
    for got, want in zip(fit.coef, TRUTH, strict=True):
        assert got == pytest.approx(want, rel=1e-3)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(step_cost_store, "store_dir", lambda: tmp_path / "step_cost")
    return tmp_path / "step_cost"


def _persisted(runner: ClockRunner, mode: str = "auto") -> CostModel:
    return persisted_calibration(
        runner,  # type: ignore[arg-type]
        vocab_size=1000,
        max_model_len=4096,
        mode=mode,
        timer=runner.clock,
    )


def test_the_persisted_fit_is_reused_across_starts(store):
    first = ClockRunner()
    fit = _persisted(first)
    assert fit.source == "calibrated" and first.calls >= 30
    files = list(store.glob("*.json"))
    assert len(files) == 1
    # the next start: a short check (one cheap shape per kind), then the stored fit
    again = ClockRunner()
    reused = _persisted(again)
    assert reused.source.startswith("stored") and again.calls == CHECK_CALLS
    assert reused.coef == pytest.approx(fit.coef, rel=1e-12)
    # a start while the machine is busy (every step 2x): the same fit, the same
    # decisions (online correction then follows the load)
    busy = ClockRunner()
    busy.slow = 2.0
    loaded = _persisted(busy)
    assert loaded.coef == pytest.approx(fit.coef, rel=1e-12)
    assert loaded.scale == pytest.approx(2.0, rel=1e-6)  # the online scale starts there
    assert reused.scale == 1.0
    slightly = ClockRunner()
    slightly.slow = 1.2  # within a quiet machine's noise: exactly the stored decisions
    assert _persisted(slightly).scale == 1.0
    # a start on a machine now clearly faster: the stored fit was measured under load
    fast = ClockRunner()
    fast.slow = 0.5
    refit = _persisted(fast)
    assert refit.source == "calibrated"
    assert refit.coef[1] == pytest.approx(TRUTH[1] * 0.5, rel=1e-3)
    stored = json.loads(files[0].read_text())
    assert stored["coef"][1] == pytest.approx(TRUTH[1] * 0.5, rel=1e-3)


def test_the_persisted_fit_is_per_fingerprint_and_mode(store):
    _persisted(ClockRunner())
    for changed in (ClockRunner(model="model-b"), ClockRunner(dtype="torch.float32")):
        assert _persisted(changed).source == "calibrated" and changed.calls >= 30
    assert len(list(store.glob("*.json"))) == 3
    # refresh: calibrate even with a stored fit; off: neither read nor write
    refresh = ClockRunner()
    assert _persisted(refresh, "refresh").source == "calibrated" and refresh.calls >= 30
    for f in store.glob("*.json"):
        f.unlink()
    off = ClockRunner()
    assert _persisted(off, "off").source == "calibrated"
    assert not list(store.glob("*.json"))
    with pytest.raises(ValueError, match="step_cost_cache"):
        _persisted(ClockRunner(), "sometimes")
    with pytest.raises(ValueError, match="step_cost_cache"):
        SchedulerConfig(step_cost_cache="sometimes").validate()


def test_a_noisy_or_unreadable_fit_is_not_kept(store):
    noisy = ClockRunner()
    noisy.spikes = {i: 1.8 for i in range(0, 200, 3)}  # every third step 1.8x
    assert _persisted(noisy).spread > step_cost.STEADY_SPREAD
    assert not list(store.glob("*.json"))  # not stored: the next start calibrates again
    _persisted(ClockRunner())
    (path,) = store.glob("*.json")
    path.write_text("{not json")
    broken = ClockRunner()
    assert _persisted(broken).source == "calibrated" and broken.calls >= 30
    data = json.loads(path.read_text())  # rewritten by that calibration
    data["coef"] = [1.0, -2.0, 0.0, 0.0, 0.0]
    path.write_text(json.dumps(data))
    assert step_cost_store.load(data["key"]) is None
    # a noisy refit after a stored one keeps the stored fit in use
    _persisted(ClockRunner(), "refresh")
    faster_but_noisy = ClockRunner()
    faster_but_noisy.slow = 0.5
    faster_but_noisy.spikes = {i: 2.5 for i in range(9, 200, 3)}
    kept = _persisted(faster_but_noisy)
    assert kept.source.startswith("stored")
    assert kept.coef == pytest.approx(TRUTH, rel=1e-3)


def test_online_scale_follows_a_machine_many_times_slower():
    model = CostModel(TRUTH)
    f = output_features({"a": 1, "b": 64}, {"a": 1100, "b": 1024}, {"a": [1], "b": [1]})
    before = model.predict_ms(f)
    for _ in range(40):
        model.observe(f, 8 * before)
    assert model.predict_ms(f) > 6 * before


def test_the_cache_mode_is_an_engine_flag():
    import argparse

    from kvserve.engine.args import (
        add_engine_arguments,
        build_engine_config,
        engine_kwargs_from_args,
    )

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    kwargs = engine_kwargs_from_args(parser.parse_args(["--step-cost-cache", "refresh"]))
    assert build_engine_config(**kwargs).scheduler.step_cost_cache == "refresh"
    assert build_engine_config().scheduler.step_cost_cache == "auto"
    with pytest.raises(ValueError, match="step_cost_cache"):
        build_engine_config(step_cost_cache="never").scheduler.resolved()


def test_the_process_cache_keeps_kv_formats_apart(store, monkeypatch):
    # an int8-KV engine must not take a bf16-KV engine's fit from the process cache
    monkeypatch.setattr(step_cost, "_CACHE", {})
    bf16 = ClockRunner()
    step_cost.cached_calibration(bf16, vocab_size=1000, max_model_len=4096)  # type: ignore[arg-type]
    int8 = ClockRunner()
    int8.kv_format = SimpleNamespace(name="int8")
    fit = step_cost.cached_calibration(int8, vocab_size=1000, max_model_len=4096)  # type: ignore[arg-type]
    assert int8.calls >= 30 and fit.source == "calibrated"  # its own calibration
    assert len(step_cost._CACHE) == 2  # one entry each


def test_one_fit_per_process_each_engine_its_own_online_state(store, monkeypatch):
    monkeypatch.setattr(step_cost, "_CACHE", {})
    runner = ClockRunner()
    first = step_cost.cached_calibration(runner, vocab_size=1000, max_model_len=4096)  # type: ignore[arg-type]
    calls = runner.calls
    second = step_cost.cached_calibration(runner, vocab_size=1000, max_model_len=4096)  # type: ignore[arg-type]
    assert runner.calls == calls and second.coef == first.coef and second is not first
    f = output_features({"a": 1}, {"a": 100}, {"a": [1]})
    for _ in range(10):
        first.observe(f, 5 * first.predict_ms(f))
    assert first.scale > 2 and second.scale == 1.0
    # another cache mode is another fit
    runner.scheduler_config = SchedulerConfig(step_cost_cache="off")
    step_cost.cached_calibration(runner, vocab_size=1000, max_model_len=4096)  # type: ignore[arg-type]
    assert runner.calls > calls


def test_lengths_that_time_the_same_steps_share_a_stored_fit(store):
    # every default shape fits whole from max_model_len 2,624 on (64 new tokens over
    # 2,560): 3,000 and 8,192 time the same steps, one fit; 1,024 cuts them, its own
    def persisted(runner: ClockRunner, max_model_len: int) -> CostModel:
        return persisted_calibration(
            runner,  # type: ignore[arg-type]
            vocab_size=1000,
            max_model_len=max_model_len,
            timer=runner.clock,
        )

    first = ClockRunner()
    assert persisted(first, 3000).source == "calibrated" and first.calls >= 30
    longer = ClockRunner()
    assert persisted(longer, 8192).source.startswith("stored") and longer.calls == CHECK_CALLS
    shorter = ClockRunner()
    assert persisted(shorter, 1024).source == "calibrated" and shorter.calls >= 30
    assert len(list(store.glob("*.json"))) == 2
    # a cache too small for the shapes cuts them too: another fit
    small = ClockRunner()
    small.num_kv_blocks = 64
    assert persisted(small, 3000).source == "calibrated"
    assert len(list(store.glob("*.json"))) == 3
