"""Fit the step-time cost model (:mod:`kvserve.sched.cost_model`) on this machine and
model at startup: a handful of timed ``ModelRunner.execute_model`` steps of chosen
shapes, then least squares.

The shapes cover each feature of the model: prefill chunks over no context and over
long ones (the attention pairs), decode batches at short and long contexts (the
decode KV reads, the sampled rows) and mixed steps. Every shape runs
``CALIBRATION_REPEATS`` times (the first shape once more, untimed, to warm up).

One fit per process and model: :func:`cached_calibration` reuses it for every
later engine on the same model, dtype, thread count, block and segment size (tests
and ``LLM`` objects build many engines), each with its own online correction.

Rules a caller must keep: call :func:`calibrate` before the engine's first step,
while no request holds KV blocks (the shapes write into free blocks 1.. of the
runner's cache and leave its input batch as they found it). A shape that does not
fit ``num_kv_blocks`` or ``max_model_len`` is scaled down or skipped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.request import SamplingParams
from kvserve.sched.cost_model import CostModel, Features, output_features
from kvserve.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

if TYPE_CHECKING:  # the runner calls cached_calibration (ModelRunner.step_cost_model)
    from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CALIBRATION_REPEATS = 2


@dataclass(frozen=True)
class Shape:
    """One calibration step: ``num_decodes`` decode rows over ``decode_context`` tokens
    each, plus ``prefill`` chunks of (new tokens, context)."""

    num_decodes: int = 0
    decode_context: int = 0
    prefill: tuple[tuple[int, int], ...] = ()

    def num_tokens(self) -> int:
        return self.num_decodes * (self.decode_context + 1) + sum(n + c for n, c in self.prefill)


# About 1.5 s in all for SmolLM2-135M in bf16 on 2 quiet Zen 5 cores.
DEFAULT_SHAPES: tuple[Shape, ...] = (
    Shape(prefill=((128, 0),)),
    Shape(prefill=((512, 0),)),
    Shape(prefill=((256, 1024),)),
    Shape(prefill=((64, 2560),)),
    Shape(num_decodes=1, decode_context=64),
    Shape(num_decodes=16, decode_context=256),
    Shape(num_decodes=32, decode_context=512),
    Shape(num_decodes=8, decode_context=2048),
    Shape(num_decodes=8, decode_context=256, prefill=((128, 512),)),
    Shape(num_decodes=4, decode_context=1024, prefill=((256, 0),)),
)
# Calibration stops taking new steps after this many seconds (a loaded machine); with
# fewer than one step per shape, the reference model scaled to the measured steps.
CALIBRATION_MAX_S = 10.0


def _fit_shape(shape: Shape, max_tokens: int, max_model_len: int) -> Shape | None:
    """``shape`` with contexts cut to ``max_model_len`` and halved until it needs at
    most ``max_tokens`` KV slots; None when nothing is left."""
    prefill = tuple(
        (min(n, max_model_len - 1), max(0, min(c, max_model_len - min(n, max_model_len - 1))))
        for n, c in shape.prefill
    )
    shape = Shape(shape.num_decodes, min(shape.decode_context, max_model_len - 1), prefill)
    while shape.num_tokens() > max_tokens:
        if shape.num_decodes > 1:
            shape = Shape(shape.num_decodes // 2, shape.decode_context, shape.prefill)
        elif any(c for _, c in shape.prefill) or shape.decode_context > 16:
            shape = Shape(
                shape.num_decodes,
                shape.decode_context // 2,
                tuple((n, c // 2) for n, c in shape.prefill),
            )
        else:
            return None
    return shape


class _Calibrator:
    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = max(2, vocab_size)
        self.params = SamplingParams(temperature=0.0, max_tokens=1)
        self.live: set[str] = set()
        self.counter = 0

    def _output(self, shape: Shape) -> SchedulerOutput:
        bs = self.runner.block_size
        next_block = 1
        new: list[NewRequestData] = []
        sched: dict[str, int] = {}
        cached: dict[str, int] = {}
        ids: dict[str, list[int]] = {}
        rows = [(1, shape.decode_context)] * shape.num_decodes + list(shape.prefill)
        for n, c in rows:
            self.counter += 1
            req_id = f"__step_cost_{self.counter}"
            total = n + c
            num_blocks = -(-total // bs)
            blocks = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            prompt = [
                1 + (self.counter * 7919 + i * 104729) % (self.vocab_size - 1) for i in range(total)
            ]
            new.append(NewRequestData(req_id, prompt, [], blocks, c, self.params))
            sched[req_id] = n
            cached[req_id] = c
            ids[req_id] = prompt[c:]
        finished, self.live = self.live, set(sched)
        return SchedulerOutput(
            phase="mixed" if shape.num_decodes and shape.prefill else "prefill",
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens=sched,
            num_scheduled_tokens_padded=dict(sched),
            scheduled_token_ids=ids,
            cached_seq_len=cached,
            finished_req_ids=finished,
        )

    def run(self, shape: Shape) -> tuple[Features, float]:
        so = self._output(shape)
        t0 = time.perf_counter()
        out = self.runner.execute_model(so)
        ms = (time.perf_counter() - t0) * 1e3
        return output_features(
            so.num_scheduled_tokens, so.cached_seq_len, out.sampled_token_ids
        ), ms

    def close(self) -> None:
        """Drop the calibration requests from the runner's input batch."""
        if self.live:
            self.runner.execute_model(
                SchedulerOutput(
                    phase="idle",
                    scheduled_new_reqs=[],
                    scheduled_cached_reqs=CachedRequestData(),
                    num_scheduled_tokens={},
                    num_scheduled_tokens_padded={},
                    scheduled_token_ids={},
                    cached_seq_len={},
                    finished_req_ids=self.live,
                )
            )
            self.live = set()


_CACHE: dict[tuple[object, ...], CostModel] = {}


def cached_calibration(runner: ModelRunner, *, vocab_size: int, max_model_len: int) -> CostModel:
    """:func:`calibrate`, once per process for a model, dtype, thread count, block and
    segment size; later calls get a fresh copy (own online state) of that fit."""
    key = (
        runner.loaded.fingerprint,
        str(runner.loaded.dtype),
        str(runner.device),
        torch.get_num_threads(),
        runner.block_size,
        runner.kv_segment_size,
        runner.compiled is not None,
        max_model_len,
    )
    model = _CACHE.get(key)
    if model is None:
        model = _CACHE[key] = calibrate(runner, vocab_size=vocab_size, max_model_len=max_model_len)
    return CostModel(model.coef, calibration=list(model.calibration), source=model.source)


def calibrate(
    runner: ModelRunner,
    *,
    vocab_size: int,
    max_model_len: int,
    shapes: tuple[Shape, ...] = DEFAULT_SHAPES,
    repeats: int = CALIBRATION_REPEATS,
    max_seconds: float = CALIBRATION_MAX_S,
) -> CostModel:
    """Time ``shapes`` on ``runner`` and fit a :class:`CostModel` (see the module
    docstring for the rules). Raises RuntimeError when no shape fits the cache.

    At most ``max_seconds`` are spent (checked between steps); when that leaves fewer
    samples than shapes, the result is :meth:`CostModel.reference` scaled by the
    median measured / predicted ratio, corrected online like a fitted one."""
    max_tokens = (runner.num_kv_blocks - 1) * runner.block_size
    fitted = [s for s in (_fit_shape(s, max_tokens, max_model_len) for s in shapes) if s]
    if not fitted:
        raise RuntimeError(
            f"step-time calibration: no shape fits {runner.num_kv_blocks} KV blocks; give the "
            "KV cache more memory or start with max_step_ms=0"
        )
    cal = _Calibrator(runner, vocab_size)
    t0 = time.perf_counter()
    samples: list[tuple[Features, float]] = []
    try:
        cal.run(fitted[0])  # warm-up: first-touch allocations, thread pools
        for _ in range(repeats):
            for shape in fitted:
                if time.perf_counter() - t0 > max_seconds:
                    break
                samples.append(cal.run(shape))
    finally:
        cal.close()
    if len(samples) >= len(fitted):
        model = CostModel.fit(samples, source="calibrated")
    else:
        model = CostModel.reference()
        ratios = sorted(ms / model.predict_ms(f) for f, ms in samples) or [1.0]
        scale = ratios[len(ratios) // 2]
        model = CostModel(
            tuple(c * scale for c in model.coef),  # type: ignore[arg-type]
            calibration=samples,
            source=f"reference x {scale:.2f} (calibration cut at {max_seconds:.0f} s)",
        )
    fit_err = [abs(model.predict_ms(f) - ms) / ms for f, ms in samples]
    logger.info(
        "step-time model (%d steps in %.1f s, median fit error %.0f%%): %s",
        len(samples),
        time.perf_counter() - t0,
        100 * sorted(fit_err)[len(fit_err) // 2] if fit_err else float("nan"),  # none timed
        model.describe(),
    )
    return model
