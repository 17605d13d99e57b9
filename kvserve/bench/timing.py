"""Where an engine step's time goes: wrappers that add each call's seconds to a
per-name total, for the step profiles in ``benchmarks/``.

Rules for callers: the wrappers replace attributes in place (on the objects given,
and :func:`time_engine_step` also on ``IncrementalDetokenizer``, a class, so every
engine of the process is timed from then on); they are for a benchmark process, not
for a server. The totals only grow: clear them between the steps you compare.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from kvserve.engine import detokenizer

Clock = Callable[[], float]

# the parts of an engine step time_engine_step times, in the order a step runs them
ENGINE_STEP_PARTS = (
    "schedule",
    "update_states",
    "prepare_inputs",
    "forward",
    "logits",
    "sample",
    "update_from_output",
    "detokenize",
)


def timed(
    fn: Callable[..., Any],
    totals: MutableMapping[str, float],
    name: str,
    *,
    clock: Clock = time.perf_counter,
    counts: MutableMapping[str, int] | None = None,
) -> Callable[..., Any]:
    """``fn`` wrapped: each call adds its ``clock()`` seconds to ``totals[name]`` (and 1
    to ``counts[name]``), also when it raises. The mappings must hold ``name`` or
    default it (a ``defaultdict``)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += clock() - t0
            if counts is not None:
                counts[name] += 1

    return wrapper


def wrap_attr(
    obj: Any,
    attr: str,
    totals: MutableMapping[str, float],
    name: str,
    *,
    clock: Clock = time.perf_counter,
    counts: MutableMapping[str, int] | None = None,
) -> None:
    """Replace ``obj.attr`` (a method or callable) by :func:`timed` of it."""
    setattr(obj, attr, timed(getattr(obj, attr), totals, name, clock=clock, counts=counts))


def time_engine_step(
    engine: Any,
    totals: MutableMapping[str, float],
    *,
    clock: Clock = time.perf_counter,
    parts: tuple[str, ...] = ENGINE_STEP_PARTS,
) -> None:
    """Time ``parts`` (names of :data:`ENGINE_STEP_PARTS`) of an ``EngineCore`` with a
    ``ModelRunner``: the scheduler's schedule and update, the input batch's updates,
    the model's forward and logits, the sampler and the detokenizer, each under its
    part's name in ``totals``. ValueError for a name not in the list."""
    runner = engine.runner
    model = runner.model
    where = {
        "schedule": (engine.scheduler, "schedule"),
        "update_states": (runner.input_batch, "update_states"),
        "prepare_inputs": (runner.input_batch, "prepare_inputs"),
        "forward": (model, "forward"),
        "logits": (model, "compute_logits"),
        "sample": (runner, "sampler"),
        "update_from_output": (engine.scheduler, "update_from_output"),
        "detokenize": (detokenizer.IncrementalDetokenizer, "update"),
    }
    unknown = set(parts) - set(where)
    if unknown:
        raise ValueError(f"unknown engine step parts {sorted(unknown)}; known: {list(where)}")
    for part in parts:
        obj, attr = where[part]
        wrap_attr(obj, attr, totals, part, clock=clock)
