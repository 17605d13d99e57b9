"""`kvserve serve` logs the step budget it chose: the token budget, the step-time
target and the prompt tokens that fit beside decodes by the attached step-time model."""

from __future__ import annotations

from types import SimpleNamespace

from kvserve.config import SchedulerConfig
from kvserve.entrypoints.serve_cmd import step_budget_line
from kvserve.sched.cost_model import CostModel


def test_step_budget_line_reports_the_model_chunk() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_step_ms=100.0, short_prompt_step_ms=0)
    model = CostModel.reference()
    sched = SimpleNamespace(config=cfg, max_num_batched_tokens=512, cost_model=model)
    line = step_budget_line(SimpleNamespace(scheduler=sched))
    assert line is not None
    chunk = model.max_chunk(100.0, 0, 512)
    assert 0 < chunk <= 512
    assert line.startswith("step budget: 512 tokens per step")
    assert f"up to {chunk} prompt tokens" in line and model.describe() in line
    model.scale = 2.0  # a slower machine fits fewer tokens, and the line says so
    slower = step_budget_line(SimpleNamespace(scheduler=sched))
    assert slower is not None and f"up to {model.max_chunk(100.0, 0, 512)} prompt" in slower
    assert model.max_chunk(100.0, 0, 512) < chunk or chunk == 512


def test_step_budget_line_without_a_cost_model() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=256)
    sched = SimpleNamespace(config=cfg, max_num_batched_tokens=256, cost_model=None)
    assert step_budget_line(SimpleNamespace(scheduler=sched)) == (
        "step budget: 256 tokens per step (no step-time target)"
    )
    assert step_budget_line(SimpleNamespace()) is None
