"""Startup calibration of the step-time cost model, and the engine feeding it."""

from __future__ import annotations

import pytest

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.request import SamplingParams
from kvserve.sim.runner import SimulatedModel, StandInRunner
from kvserve.worker.step_cost import Shape, _fit_shape, calibrate


def _sim_engine(max_step_ms: float) -> tuple[EngineCore, StandInRunner]:
    runner = StandInRunner(200)
    engine = EngineCore(
        EngineConfig(
            cache=CacheConfig(num_kv_blocks=200),
            scheduler=SchedulerConfig(max_model_len=512, max_step_ms=max_step_ms),
        ),
        loaded=SimulatedModel(512),
        runner=runner,
        clock=runner.clock,
    )
    runner.engine = engine
    return engine, runner


def test_engine_feeds_measured_steps_to_the_cost_model():
    engine, runner = _sim_engine(100.0)
    model = engine.scheduler.cost_model
    assert model is runner.cost_model
    for i in range(3):
        r = engine.make_request(list(range(10, 10 + 40 * (i + 1))), SamplingParams(max_tokens=5))
        runner.requests[r.req_id] = r
        engine.add(r)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert len(model.errors) == steps
    assert all(p > 0 and m > 0 for p, m in model.errors)
    stats = engine.stats()
    assert stats.step_predicted_ms == model.errors[-1][0] and stats.step_measured_ms > 0
    off, _ = _sim_engine(0.0)
    assert off.scheduler.cost_model is None and off.stats().step_predicted_ms == 0.0


def test_shapes_are_cut_to_the_cache_and_the_context():
    s = Shape(num_decodes=32, decode_context=2048, prefill=((512, 1536),))
    fitted = _fit_shape(s, 10_000, 8192)
    assert fitted is not None and fitted.num_tokens() <= 10_000 and fitted.prefill[0][0] == 512
    short = _fit_shape(Shape(prefill=((1024, 2560),)), 100_000, 1024)
    assert short is not None and sum(short.prefill[0]) <= 1024
    assert _fit_shape(Shape(prefill=((512, 0),)), 100, 8192) is None


@pytest.mark.slow
def test_calibrate_on_the_default_model(loaded_model):
    from kvserve.worker.model_runner import ModelRunner

    runner = ModelRunner(loaded_model, CacheConfig(num_kv_blocks=120), SchedulerConfig())
    shapes = (
        Shape(prefill=((32, 0),)),
        Shape(prefill=((128, 0),)),
        Shape(prefill=((64, 256),)),
        Shape(num_decodes=1, decode_context=16),
        Shape(num_decodes=8, decode_context=64),
        Shape(num_decodes=4, decode_context=256),
        Shape(num_decodes=4, decode_context=32, prefill=((64, 64),)),
    )
    model = calibrate(runner, vocab_size=loaded_model.vocab_size, max_model_len=1024, shapes=shapes)
    assert all(c >= 0 for c in model.coef) and model.predict_rows_ms([(128, 0, True)]) > 0
    assert len(model.calibration) >= 1
    assert runner.input_batch.requests == {}  # the calibration requests are gone
    # the runner still serves a real step afterwards
    from kvserve.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    so = SchedulerOutput(
        phase="prefill",
        scheduled_new_reqs=[
            NewRequestData("r", [5, 6, 7, 8], [], [1], 0, SamplingParams(temperature=0.0))
        ],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"r": 4},
        num_scheduled_tokens_padded={"r": 4},
        scheduled_token_ids={"r": [5, 6, 7, 8]},
        cached_seq_len={"r": 0},
    )
    assert len(runner.execute_model(so).sampled_token_ids["r"]) == 1


def test_a_runner_without_a_step_cost_model_gets_token_budgets_only():
    from support.fake_runner import FakeModel, FakeRunner

    runner = FakeRunner()
    assert not hasattr(runner, "step_cost_model")
    engine = EngineCore(
        EngineConfig(
            cache=CacheConfig(num_kv_blocks=runner.num_kv_blocks),
            scheduler=SchedulerConfig(max_model_len=256, max_step_ms=100.0),
        ),
        loaded=FakeModel(tokenizer=list(range(300))),
        runner=runner,
    )
    assert engine.scheduler.cost_model is None
