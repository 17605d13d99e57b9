"""Fit the step-time cost model (:mod:`kvserve.sched.cost_model`) on this machine and
model at startup: a handful of timed ``ModelRunner.execute_model`` steps of chosen
shapes, then least squares.

The shapes cover each feature of the model: prefill chunks over no context and over
long ones (the attention pairs), decode batches at short and long contexts (the
decode KV reads, the sampled rows) and mixed steps. One shape of each kind (prefill,
decode, mixed) runs once untimed first (first-touch allocations, thread pools: a
kind's first step measured 10-25 % slower), then every shape runs
``CALIBRATION_REPEATS`` times and the fit is made on each shape's **median** time, so
one step slowed by another process does not move it.

Reuse, so that starts agree: a fit is kept once per process and model
(:func:`cached_calibration`, for every later engine on the same runner
configuration: tests and ``LLM`` objects build many), and persisted per machine,
model and the shapes as cut to the cache and ``max_model_len`` (two lengths that time
the same steps share one fit; :mod:`kvserve.worker.step_cost_store`,
``step_cost_cache``): a later start reuses the stored fit after a short check
(:func:`check_ratio`) unless the machine now runs clearly faster than it says (then
the stored one was measured under load: refitted and replaced). Each engine gets its
own online correction.

Rules a caller must keep: call :func:`calibrate` before the engine's first step,
while no request holds KV blocks (the shapes write into free blocks 1.. of the
runner's cache and leave its input batch as they found it). A shape that does not
fit ``num_kv_blocks`` or ``max_model_len`` is scaled down or skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.request import SamplingParams
from kvserve.sched.cost_model import SCALE_BOUNDS, CostModel, Features, output_features
from kvserve.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from kvserve.worker import step_cost_store
from kvserve.worker.step_cost_store import TimedRunner

logger = logging.getLogger(__name__)

CALIBRATION_REPEATS = 3
# Persist a fresh fit only when its repeats agree: median over shapes of slowest /
# fastest repeat at most this (a machine busy with other work spreads far more).
STEADY_SPREAD = 1.3
# Reuse a stored fit unless the check steps run faster than this fraction of its
# prediction (the stored fit was measured on a loaded machine).
# Timed runs per kind in the check (after one untimed run). One suffices: the reuse
# rule (FASTER_THAN_STORED) and the busy-start rule (LOADED_AT_START) are 20-50 % wide,
# the median over three kinds absorbs one slow step, and the online scale corrects the
# rest within a few steps; each extra run costs an 8B start about 3 s.
CHECK_TIMED_RUNS = 1
FASTER_THAN_STORED = 0.8
# Above this check ratio the machine is busy at start: the reused fit's online scale
# starts at the ratio (a quiet start, within the check's noise, starts at 1: the same
# decisions every time).
LOADED_AT_START = 1.5


@dataclass(frozen=True)
class Shape:
    """One calibration step: ``num_decodes`` decode rows over ``decode_context`` tokens
    each, plus ``prefill`` chunks of (new tokens, context)."""

    num_decodes: int = 0
    decode_context: int = 0
    prefill: tuple[tuple[int, int], ...] = ()

    def num_tokens(self) -> int:
        return self.num_decodes * (self.decode_context + 1) + sum(n + c for n, c in self.prefill)


# About 0.9 s a pass for SmolLM2-135M in bf16 on 2 quiet Zen 5 cores (3 passes + warm-up).
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
# The shapes above are sized for a model of about this many linear weights per token
# (SmolLM2-135M: 106 M). A larger model runs them with prefill chunks scaled down by
# the ratio (at most MAX_SHAPE_SHRINK, chunks of at least MIN_PREFILL_CHUNK tokens) and
# a time limit scaled up by what is left of it (at most MAX_CALIBRATION_S): an 8B
# model's 512-token chunk alone takes ~10 s on 2 cores.
REFERENCE_LINEAR_WEIGHTS = 106e6
MAX_SHAPE_SHRINK = 16
MIN_PREFILL_CHUNK = 16
MAX_CALIBRATION_S = 60.0


def linear_weights_per_token(arch: object) -> float:
    """Weights of every linear a token passes through (its prefill FLOPs / 2), from an
    architecture config with ``hidden_size``, ``num_layers``, ``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``intermediate_size`` and ``vocab_size``."""
    h = int(getattr(arch, "hidden_size", 0))
    q = int(getattr(arch, "num_heads", 0)) * int(getattr(arch, "head_dim", 0))
    kv = int(getattr(arch, "num_kv_heads", 0)) * int(getattr(arch, "head_dim", 0))
    inter = int(getattr(arch, "intermediate_size", 0))
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return float(int(getattr(arch, "num_layers", 0)) * per_layer)


def shapes_for_size(
    shapes: tuple[Shape, ...], linear_weights: float
) -> tuple[tuple[Shape, ...], float]:
    """(``shapes`` with prefill chunks scaled to a model of ``linear_weights`` per
    token, the calibration time limit in seconds): unchanged for models up to
    :data:`REFERENCE_LINEAR_WEIGHTS`."""
    ratio = linear_weights / REFERENCE_LINEAR_WEIGHTS if linear_weights > 0 else 1.0
    if ratio <= 1.0:
        return shapes, CALIBRATION_MAX_S
    shrink = min(ratio, MAX_SHAPE_SHRINK)

    def chunk(n: int) -> int:
        return max(MIN_PREFILL_CHUNK, int(n / shrink) // MIN_PREFILL_CHUNK * MIN_PREFILL_CHUNK)

    scaled = tuple(
        Shape(s.num_decodes, s.decode_context, tuple((chunk(n), c) for n, c in s.prefill))
        for s in shapes
    )
    return scaled, min(MAX_CALIBRATION_S, CALIBRATION_MAX_S * max(1.0, ratio / shrink))


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
    def __init__(self, runner: TimedRunner, vocab_size: int) -> None:
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

    def run(
        self, shape: Shape, timer: Callable[[], float] = time.perf_counter
    ) -> tuple[Features, float]:
        so = self._output(shape)
        t0 = timer()
        out = self.runner.execute_model(so)
        ms = (timer() - t0) * 1e3
        return output_features(
            so.num_scheduled_tokens, so.cached_seq_len, out.sampled_token_ids
        ), ms

    def close(self) -> None:
        """Drop the calibration requests from the runner's input batch."""
        if self.live:
            self.runner.execute_model(SchedulerOutput.idle(finished_req_ids=self.live))
            self.live = set()


def _kind(shape: Shape) -> str:
    if shape.num_decodes and shape.prefill:
        return "mixed"
    return "decode" if shape.num_decodes else "prefill"


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


_CACHE: dict[tuple[object, ...], CostModel] = {}


def cached_calibration(runner: TimedRunner, *, vocab_size: int, max_model_len: int) -> CostModel:
    """The runner's step-time fit, once per process for a model, dtype, thread count,
    block and segment size and the shapes as cut to the runner's cache and
    ``max_model_len`` (later calls get a fresh copy with its own online state),
    persisted across starts by ``runner.scheduler_config.step_cost_cache``:

    - ``auto``: reuse the fit stored for this key (:mod:`step_cost_store`) unless
      :func:`check_ratio` finds the machine faster than it by more than
      ``FASTER_THAN_STORED`` (a ratio above ``LOADED_AT_START`` becomes the reused
      fit's initial online scale); otherwise (none stored, or faster) calibrate, and store
      the new fit when its repeats agree (``STEADY_SPREAD``);
    - ``refresh``: calibrate, store when steady; ``off``: calibrate, nothing stored.
    """
    mode = getattr(runner.scheduler_config, "step_cost_cache", "auto")
    arch = getattr(getattr(runner.loaded, "model", None), "config", None)
    shapes, max_s = shapes_for_size(DEFAULT_SHAPES, linear_weights_per_token(arch))
    # the stored fit's own key (KV format, kernels and attention backend included), so
    # an engine never takes another's fit from this process's cache either
    fitted = tuple(_fitted_shapes(runner, shapes, max_model_len))  # what max_model_len changes
    key = (tuple(sorted(step_cost_store.fit_key(runner, fitted).items())), mode)
    model = _CACHE.get(key)
    if model is None:
        model = _CACHE[key] = persisted_calibration(
            runner, vocab_size=vocab_size, max_model_len=max_model_len, mode=mode,
            shapes=shapes, max_seconds=max_s,
        )  # fmt: skip
    copy = CostModel(
        model.coef, calibration=list(model.calibration), source=model.source, scale=model.scale
    )
    copy.spread = model.spread
    return copy


def persisted_calibration(
    runner: TimedRunner,
    *,
    vocab_size: int,
    max_model_len: int,
    mode: str = "auto",
    shapes: tuple[Shape, ...] = DEFAULT_SHAPES,
    timer: Callable[[], float] = time.perf_counter,
    max_seconds: float = CALIBRATION_MAX_S,
) -> CostModel:
    """One fit for ``runner`` under cache ``mode`` (see :func:`cached_calibration`)."""
    if mode not in step_cost_store.CACHE_MODES:
        raise ValueError(
            f"invalid step_cost_cache={mode!r}: must be one of "
            f"{', '.join(step_cost_store.CACHE_MODES)} (for example: step_cost_cache='auto')"
        )
    store_key = (
        step_cost_store.fit_key(runner, tuple(_fitted_shapes(runner, shapes, max_model_len)))
        if mode != "off"
        else None
    )
    stored: CostModel | None = None
    if store_key is not None and mode == "auto":
        stored = step_cost_store.load(store_key)
        if stored is not None:
            ratio = check_ratio(
                runner, stored, vocab_size=vocab_size, max_model_len=max_model_len,
                shapes=shapes, timer=timer,
            )  # fmt: skip
            if ratio >= FASTER_THAN_STORED:
                if ratio > LOADED_AT_START:  # busy now: start the online scale there
                    stored.scale = min(ratio, SCALE_BOUNDS[1])
                logger.info(
                    "step-time model reused (check steps at %.2fx its prediction, scale %.2f): %s",
                    ratio,
                    stored.scale,
                    stored.describe(),
                )
                return stored
            logger.info(
                "stored step-time fit is slower than this machine now (check at %.2fx): refitting",
                ratio,
            )
    model = calibrate(
        runner, vocab_size=vocab_size, max_model_len=max_model_len, shapes=shapes, timer=timer,
        max_seconds=max_seconds,
    )  # fmt: skip
    if store_key is None:
        return model
    if is_steady(model):
        path = step_cost_store.save(store_key, model)
        if path is not None:
            logger.info("step-time fit stored in %s", path)
        return model
    logger.info(
        "step-time fit not stored: repeats spread %.2fx (steady: <= %.2fx), %s; %s",
        model.spread,
        STEADY_SPREAD,
        model.source,
        "the stored fit stays in use" if stored is not None else "the next start calibrates again",
    )
    return stored if stored is not None else model


def is_steady(model: CostModel) -> bool:
    """Whether a fresh fit may be persisted: fitted on every shape (not the
    reference fallback) with repeats that agree within ``STEADY_SPREAD``."""
    return model.source == "calibrated" and 0 < model.spread <= STEADY_SPREAD


def _fitted_shapes(
    runner: TimedRunner, shapes: tuple[Shape, ...], max_model_len: int
) -> list[Shape]:
    max_tokens = (runner.num_kv_blocks - 1) * runner.block_size
    return [s for s in (_fit_shape(s, max_tokens, max_model_len) for s in shapes) if s]


def check_ratio(
    runner: TimedRunner,
    model: CostModel,
    *,
    vocab_size: int,
    max_model_len: int,
    shapes: tuple[Shape, ...] = DEFAULT_SHAPES,
    timer: Callable[[], float] = time.perf_counter,
) -> float:
    """Measured / predicted time of the cheapest shape of each kind (each run once
    untimed, then ``CHECK_TIMED_RUNS`` times, the fastest counted), median over kinds.
    Below 1 the machine runs faster than ``model`` says. Also warms the runner up.
    Costs about (1 + CHECK_TIMED_RUNS) x 3 small steps: 0.3 s on the default model,
    ~5 s on an 8B."""
    fitted = _fitted_shapes(runner, shapes, max_model_len)
    cal = _Calibrator(runner, vocab_size)
    ratios: list[float] = []
    try:
        for kind in ("prefill", "decode", "mixed"):
            of_kind = [s for s in fitted if _kind(s) == kind]
            if not of_kind:
                continue
            shape = min(of_kind, key=lambda s: s.num_tokens())
            cal.run(shape, timer)
            times = [cal.run(shape, timer) for _ in range(CHECK_TIMED_RUNS)]
            features, ms = min(times, key=lambda t: t[1])
            predicted = model.predict_ms(features)
            if predicted > 0 and ms > 0:
                ratios.append(ms / predicted)
    finally:
        cal.close()
    return _median(ratios) if ratios else 1.0


def calibrate(
    runner: TimedRunner,
    *,
    vocab_size: int,
    max_model_len: int,
    shapes: tuple[Shape, ...] = DEFAULT_SHAPES,
    repeats: int = CALIBRATION_REPEATS,
    max_seconds: float = CALIBRATION_MAX_S,
    timer: Callable[[], float] = time.perf_counter,
) -> CostModel:
    """Time ``shapes`` on ``runner`` and fit a :class:`CostModel` on each shape's
    median time (see the module docstring for the rules); ``spread`` on the result is
    the median over shapes of slowest / fastest repeat. Raises RuntimeError when no
    shape fits the cache. ``timer`` (seconds) is for tests.

    At most ``max_seconds`` are spent (checked between steps); when that leaves a shape
    untimed, the result is :meth:`CostModel.reference` scaled by the median measured /
    predicted ratio, corrected online like a fitted one."""
    fitted = _fitted_shapes(runner, shapes, max_model_len)
    if not fitted:
        raise RuntimeError(
            f"step-time calibration: no shape fits {runner.num_kv_blocks} KV blocks; give the "
            "KV cache more memory or start with max_step_ms=0"
        )
    cal = _Calibrator(runner, vocab_size)
    t0 = timer()
    times: list[list[float]] = [[] for _ in fitted]
    features: list[Features | None] = [None] * len(fitted)
    warm_up: list[tuple[Features, float]] = []
    try:
        warmed: set[str] = set()
        for shape in fitted:  # warm-up: the first step of each kind, not fitted
            if _kind(shape) not in warmed:
                warmed.add(_kind(shape))
                warm_up.append(cal.run(shape, timer))
        for _ in range(repeats):
            for i, shape in enumerate(fitted):
                if timer() - t0 > max_seconds:
                    break
                features[i], ms = cal.run(shape, timer)
                times[i].append(ms)
    finally:
        cal.close()
    samples = [(f, _median(t)) for f, t in zip(features, times, strict=True) if f is not None]
    spreads = [max(t) / min(t) for t in times if len(t) > 1 and min(t) > 0]
    if len(samples) == len(fitted):
        model = CostModel.fit(samples, source="calibrated")
    else:
        model = CostModel.reference()
        scaled = samples or warm_up  # the warm-up steps' times when nothing else ran
        ratios = sorted(ms / model.predict_ms(f) for f, ms in scaled) or [1.0]
        scale = ratios[len(ratios) // 2]
        model = CostModel(
            tuple(c * scale for c in model.coef),  # type: ignore[arg-type]
            calibration=samples,
            source=f"reference x {scale:.2f} (calibration cut at {max_seconds:.0f} s)",
        )
    model.spread = _median(spreads) if spreads else 0.0
    fit_err = [abs(model.predict_ms(f) - ms) / ms for f, ms in samples]
    logger.info(
        "step-time model (%d steps in %.1f s, repeats spread %.2fx, median fit error %.0f%%): %s",
        sum(len(t) for t in times),
        timer() - t0,
        model.spread,
        100 * _median(fit_err) if fit_err else float("nan"),  # none timed
        model.describe(),
    )
    return model
