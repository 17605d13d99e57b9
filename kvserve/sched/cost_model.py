"""How long a step takes: a linear cost model of this machine and model, asked by the
policies ("how many prompt tokens fit in this step beside these decodes?").

A step is a list of rows, one per scheduled request: ``n`` new tokens computed over
``c`` tokens of context that already have KV. Its predicted time is::

    t = scale * (  overhead                         per step
                 + per_token       * sum(n)          linears, norms, embeddings
                 + per_prefill_pair * sum over rows with n > 1 of  n*c + n*(n+1)/2
                 + per_decode_ctx  * sum over rows with n == 1 of c + 1
                 + per_sampled_row * rows that sample (decodes, last prompt chunks))

The two attention terms differ because prefill attention is compute-bound
(every new token against every earlier one: the pairs) while decode attention reads
the KV once per row (memory-bound). The coefficients are fitted, by non-negative
least squares, from timed forward passes of chosen shapes at startup
(:mod:`kvserve.worker.step_cost`), then corrected online from the engine's measured
step times (:meth:`CostModel.observe`): every step moves ``scale`` toward
measured / predicted (an exponentially weighted mean in log space) and, every
``REFIT_EVERY`` steps, the coefficients are refitted on the calibration samples plus
the most recent measured steps (``scale`` back to 1).

Prompt rows (``n > 1``) carry a second factor, ``prompt_scale``, on top of ``scale``:
the calibration times prompt chunks and decodes in separate shapes, and on a server a
chunk over a long cached context beside many decodes ran 1.3-1.9x its fitted time
while decode-only steps stayed within a few per cent. One shared factor cannot fix
both: the decode-only steps between two prompt waves pulled it back to 1. So a step's
log error moves each factor by the share of the prediction it owns (decode-only
steps move only ``scale``), and ``prompt_scale`` survives refits.

Nothing here measures time or imports torch: the engine passes measured durations in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

NUM_FEATURES = 5
FEATURE_NAMES = (
    "overhead",
    "per_token",
    "per_prefill_pair",
    "per_decode_ctx",
    "per_sampled_row",
)
# Online correction: weight of one step in the log-scale EWMA, and the scale's bounds.
SCALE_ALPHA = 0.1
SCALE_BOUNDS = (0.1, 10.0)  # a stored quiet fit on a machine up to 10x slower
# The prompt rows' own factor (CostModel.prompt_scale): steps with prompt chunks are
# rarer than decode-only ones, so it learns faster; bounded relative to ``scale``.
PROMPT_SCALE_ALPHA = 0.25
PROMPT_SCALE_BOUNDS = (0.25, 4.0)
# Refit on calibration + the last RECENT_SAMPLES measured steps every REFIT_EVERY steps.
REFIT_EVERY = 64
RECENT_SAMPLES = 512
# A step of short prompts beside decodes may last at least this many times its
# decodes' predicted time (StepBudget.short_ms): prompts keep half of it.
SHORT_DECODE_FACTOR = 2.0
# A prompt counts as long (its chunk lifts the step to the full target) only when its
# remaining work is predicted above this many times the short target: a prompt near the
# line (the online scale moves predictions by 10-20 %) takes two short steps instead of
# lifting a step, and every stream's wait, to the full target.
LONG_PROMPT_FACTOR = 2.0
# Predicted-vs-measured pairs kept in ``CostModel.errors`` (the most recent).
ERROR_HISTORY = 4096

Features = tuple[float, float, float, float, float]


def row_features(num_new: int, context: int, samples: bool) -> Features:
    """The feature vector of one row (without the per-step overhead term)."""
    if num_new <= 0:
        return (0.0, 0.0, 0.0, 0.0, 0.0)
    if num_new == 1:
        return (0.0, 1.0, 0.0, float(context + 1), 1.0 if samples else 0.0)
    pairs = num_new * context + num_new * (num_new + 1) / 2
    return (0.0, float(num_new), float(pairs), 0.0, 1.0 if samples else 0.0)


def prompt_features(rows: Iterable[tuple[int, int, bool]]) -> Features:
    """The features of a step's prompt-chunk rows, without the per-step overhead: what
    :attr:`CostModel.prompt_scale` multiplies. Pass only prompt chunks (a speculative
    verification row also has ``n > 1`` but is a decode: leave it out); a chunk of one
    token counts as a decode row and is skipped here."""
    acc = [0.0] * NUM_FEATURES
    for n, c, s in rows:
        if n > 1:
            f = row_features(n, c, s)
            for i in range(1, NUM_FEATURES):
                acc[i] += f[i]
    return (0.0, acc[1], acc[2], acc[3], acc[4])


def step_features(rows: Iterable[tuple[int, int, bool]]) -> Features:
    """Features of a step of ``(num_new, context, samples)`` rows (overhead counts 1
    when any row computes a token)."""
    acc = [0.0] * NUM_FEATURES
    for n, c, s in rows:
        f = row_features(n, c, s)
        for i in range(1, NUM_FEATURES):
            acc[i] += f[i]
    acc[0] = 1.0 if acc[1] > 0 else 0.0
    return (acc[0], acc[1], acc[2], acc[3], acc[4])


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(rhs)
    m = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col and m[r][col] != 0.0:
                f = m[r][col] / m[col][col]
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_coefficients(
    samples: Sequence[tuple[Sequence[float], float]],
    *,
    relative: bool = True,
    ridge: float = 1e-9,
) -> Features:
    """Non-negative least squares fit of ``ms ~ coef . features``.

    With ``relative`` each sample is weighted by ``1 / ms`` so that the fit minimises
    relative errors (a 20 ms decode step counts as much as a 900 ms prefill). Features
    are normalised to unit scale before solving; ``ridge`` keeps an unidentified
    coefficient (a feature absent from every sample) at 0. A coefficient the
    unconstrained fit makes negative is fixed at 0 and the rest refitted (active set).
    Raises ValueError when ``samples`` is empty or a time is not positive.
    """
    if not samples:
        raise ValueError("fit_coefficients: no samples to fit")
    for _, ms in samples:
        if not ms > 0:
            raise ValueError(f"fit_coefficients: step time {ms!r} ms must be > 0")
    scales = [max((abs(f[i]) for f, _ in samples), default=0.0) or 1.0 for i in range(NUM_FEATURES)]
    rows = [([f[i] / scales[i] for i in range(NUM_FEATURES)], ms) for f, ms in samples]
    active = [i for i in range(NUM_FEATURES) if any(r[0][i] for r in rows)]
    coef = [0.0] * NUM_FEATURES
    while active:
        k = len(active)
        ata = [[0.0] * k for _ in range(k)]
        aty = [0.0] * k
        for x, ms in rows:
            w = 1.0 / (ms * ms) if relative else 1.0
            xs = [x[i] for i in active]
            for a in range(k):
                aty[a] += w * xs[a] * ms
                for b in range(k):
                    ata[a][b] += w * xs[a] * xs[b]
        for a in range(k):
            ata[a][a] += ridge * (ata[a][a] or 1.0)
        sol = _solve(ata, aty)
        if sol is None:
            active.pop()
            continue
        negative = [active[a] for a in range(k) if sol[a] < 0]
        if not negative:
            for a in range(k):
                coef[active[a]] = sol[a]
            break
        worst = min(range(k), key=lambda a: sol[a])
        active.pop(worst)
    out = [coef[i] / scales[i] for i in range(NUM_FEATURES)]
    return (out[0], out[1], out[2], out[3], out[4])


@dataclass
class CostModel:
    """Predicted step times in milliseconds; see the module docstring.

    Rules for callers: ``coef`` holds non-negative milliseconds per unit of each
    feature (:data:`FEATURE_NAMES`); :meth:`observe` is called with each executed
    step's features and its measured time, from the one thread that drives the
    engine. The policies only read (:meth:`predict_ms`, :meth:`budget`).
    """

    coef: Features
    calibration: list[tuple[Features, float]] = field(default_factory=list)
    source: str = "fitted"
    scale: float = 1.0
    recent: deque[tuple[Features, float]] = field(
        default_factory=lambda: deque(maxlen=RECENT_SAMPLES)
    )
    errors: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=ERROR_HISTORY))
    num_observed: int = 0
    online: bool = True
    abs_error_ewma: float = 0.0  # moving mean of |predicted - measured| / measured
    prompt_scale: float = 1.0  # extra factor of prompt rows (n > 1); see the module doc
    # calibration noise: median over shapes of slowest / fastest repeat (0 = unknown)
    spread: float = 0.0

    @classmethod
    def fit(cls, samples: Sequence[tuple[Features, float]], source: str = "fitted") -> CostModel:
        """A model fitted on ``samples`` (kept as the calibration set for refits)."""
        return cls(fit_coefficients(samples), calibration=list(samples), source=source)

    @classmethod
    def reference(cls) -> CostModel:
        """Fixed coefficients of the default model (SmolLM2-135M, bf16) on a 2-core
        Zen 5, for the simulator and tests: 6 ms per step, 0.3 ms per token, 1.5e-5 ms
        per prefill pair, 1e-4 ms per decode context token, 0.2 ms per sampled row."""
        return cls((6.0, 0.3, 1.5e-5, 1e-4, 0.2), source="reference", online=False)

    # ------------------------------------------------------------------ prediction
    def raw_ms(self, features: Sequence[float]) -> float:
        return _dot(self.coef, features)

    def predict_ms(self, features: Sequence[float], prompt: Sequence[float] | None = None) -> float:
        """Predicted milliseconds of a step with these features (scale applied);
        ``prompt``, the part of ``features`` that is prompt rows (:func:`prompt_features`),
        also gets :attr:`prompt_scale` (None: the step is counted as decodes only)."""
        raw = self.raw_ms(features)
        if prompt is not None and self.prompt_scale != 1.0:
            raw += (self.prompt_scale - 1.0) * self.raw_ms(prompt)
        return self.scale * raw

    def predict_rows_ms(
        self,
        rows: Iterable[tuple[int, int, bool]],
        prompt_rows: Iterable[tuple[int, int, bool]] | None = None,
    ) -> float:
        """Predicted milliseconds of a step of ``rows``, of which ``prompt_rows`` are
        prompt chunks (None: every row with ``n > 1``)."""
        rows = list(rows)
        return self.predict_ms(
            step_features(rows), prompt_features(rows if prompt_rows is None else prompt_rows)
        )

    def chunk_ms(self, num_new: int, context: int, samples: bool = False) -> float:
        """Predicted extra milliseconds of adding one row to a step (no overhead)."""
        ms = self.predict_ms(row_features(num_new, context, samples))
        return ms * self.prompt_scale if num_new > 1 else ms

    def max_chunk(self, time_ms: float, context: int, limit: int) -> int:
        """The most new tokens (<= ``limit``) of a prompt at ``context`` whose row costs at
        most ``time_ms`` (ignoring the one sampled row of a last chunk); 0 when none."""
        if limit <= 0 or time_ms <= 0:
            return 0
        k = self.scale * self.prompt_scale
        a = k * self.coef[2] / 2  # pairs: n*c + n(n+1)/2
        b = k * (self.coef[1] + self.coef[2] * (context + 0.5))
        if a <= 0:
            n = limit if b <= 0 else int(time_ms / b)
        else:
            n = int((-b + math.sqrt(b * b + 4 * a * time_ms)) / (2 * a))
        n = max(0, min(limit, n))
        while n > 0 and self.chunk_ms(n, context) > time_ms * (1 + 1e-9):
            n -= 1  # float rounding at the boundary
        return n

    def budget(self, target_ms: float, short_target_ms: float = 0.0) -> StepBudget:
        """A fresh time budget of ``target_ms`` for one step (the overhead is spent);
        ``short_target_ms`` (0 = off) is the target while its prompts are all short
        (see :class:`StepBudget`)."""
        return StepBudget(self, target_ms, short_target_ms)

    # ------------------------------------------------------------------ online correction
    def observe(
        self, features: Features, measured_ms: float, prompt: Features | None = None
    ) -> float:
        """Record one executed step; returns the prediction it had (before correcting).

        ``prompt`` is the prompt rows' part of ``features`` (:func:`prompt_features`;
        None: counted as decodes only). The log error ``log(measured / predicted)``
        moves ``scale`` by the decode part's share of the prediction and
        :attr:`prompt_scale` by the prompt part's (when ``online``), and the model
        refits every ``REFIT_EVERY`` steps. Steps with no tokens, or a time that is not
        positive, are ignored (returns 0)."""
        predicted = self.predict_ms(features, prompt)
        if features[1] <= 0 or not measured_ms > 0 or predicted <= 0:
            return 0.0
        self.errors.append((predicted, measured_ms))
        err = abs(predicted - measured_ms) / measured_ms
        self.abs_error_ewma += (err - self.abs_error_ewma) * (
            1.0 if len(self.errors) == 1 else 0.05
        )
        if not self.online:
            return predicted
        self.num_observed += 1
        self.recent.append((features, measured_ms))
        log_ratio = math.log(measured_ms / predicted)
        share = 0.0
        if prompt is not None:
            share = min(1.0, self.scale * self.prompt_scale * self.raw_ms(prompt) / predicted)
            ps = self.prompt_scale * math.exp(PROMPT_SCALE_ALPHA * share * log_ratio)
            self.prompt_scale = min(max(ps, PROMPT_SCALE_BOUNDS[0]), PROMPT_SCALE_BOUNDS[1])
        scale = self.scale * math.exp(SCALE_ALPHA * (1.0 - share) * log_ratio)
        self.scale = min(max(scale, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
        if self.num_observed % REFIT_EVERY == 0:
            self.refit()
        return predicted

    def refit(self) -> None:
        """Refit on the calibration samples plus the recent measured steps (scale 1;
        :attr:`prompt_scale` is kept: the refit's features do not separate prompt rows,
        and the next prompt steps correct it)."""
        samples = list(self.calibration) + list(self.recent)
        if len(samples) < NUM_FEATURES:
            return
        self.coef = fit_coefficients(samples)
        self.scale = 1.0

    def describe(self) -> str:
        c = self.coef
        return (
            f"{self.source}: {c[0]:.2f} ms/step + {c[1] * 1e3:.1f} us/token + "
            f"{c[2] * 1e6:.2f} ns/prefill pair + {c[3] * 1e6:.1f} ns/decode ctx token + "
            f"{c[4] * 1e3:.1f} us/sampled row"
        )


class StepBudget:
    """The time left in one step as a policy fills it.

    Two targets: ``target_ms``, and ``short_target_ms`` (at most ``target_ms``; equal
    when off) for a step whose prompt chunks all belong to short prompts, raised to
    ``SHORT_DECODE_FACTOR`` times the decode rows' predicted time when they alone take
    more than half of it (:attr:`short_ms`). A prompt is
    short when the whole of its remaining work (its remaining tokens at its context,
    one sampled row; the caller decides from where: the scheduler counts from its
    prefix-cache hit, so a long prompt's last chunk stays long) is predicted to take at
    most ``LONG_PROMPT_FACTOR`` times the short target: a short prompt
    waits at most a short step or two if it does not fit, while a long one would pay every
    step's decode time again per chunk, so only a long prompt's chunk lifts the step
    to ``target_ms`` (then later chunks of the step, short or not, may fill it).

    Rules for callers: :meth:`add` every row scheduled (decodes and chunks, in any
    order; prompt chunks with ``prompt=True`` and ``short`` from :meth:`is_short`),
    ask :meth:`prompt_tokens` before scheduling a prompt chunk, then :meth:`add` the
    chunk actually scheduled.
    """

    def __init__(self, model: CostModel, target_ms: float, short_target_ms: float = 0.0) -> None:
        self.model = model
        self.target_ms = target_ms
        self.short_target_ms = min(short_target_ms, target_ms) if short_target_ms > 0 else target_ms
        self.rows: list[tuple[int, int, bool]] = []
        self.prompt_rows: list[tuple[int, int, bool]] = []  # rows added with prompt=True
        self.num_prompt_tokens = 0
        self.has_long_prompt = False  # a long prompt's chunk is in the step

    @property
    def predicted_ms(self) -> float:
        return self.model.predict_rows_ms(self.rows, self.prompt_rows) if self.rows else 0.0

    def _left(self, target: float) -> float:
        overhead = 0.0 if self.rows else self.model.scale * self.model.coef[0]
        return target - self.predicted_ms - overhead

    @property
    def short_ms(self) -> float:
        """The short target in effect: ``short_target_ms``, but at least
        ``SHORT_DECODE_FACTOR`` times the predicted time of the step's decode rows (so
        prompts keep at least half of a short step however slow the decodes are), and
        at most ``target_ms``."""
        if self.short_target_ms >= self.target_ms:
            return self.target_ms
        decode_rows = [r for r in self.rows if r[0] == 1]
        decode_ms = self.model.predict_rows_ms(decode_rows, ()) if decode_rows else 0.0
        return min(self.target_ms, max(self.short_target_ms, SHORT_DECODE_FACTOR * decode_ms))

    def is_short(self, context: int, remaining: int | None) -> bool:
        """Whether a prompt with ``remaining`` tokens left at ``context`` is short: its
        work fits ``LONG_PROMPT_FACTOR`` times :attr:`short_ms` (None: unknown, counted
        long). A short prompt's chunks still fill only up to :attr:`short_ms`, so one
        between the two takes two short steps."""
        if remaining is None or remaining <= 0 or self.short_target_ms >= self.target_ms:
            return False
        return self.model.chunk_ms(remaining, context, True) <= LONG_PROMPT_FACTOR * self.short_ms

    def add(
        self,
        num_new: int,
        context: int,
        samples: bool = True,
        *,
        prompt: bool = False,
        short: bool = False,
    ) -> None:
        """Count a scheduled row; ``prompt`` rows add to :attr:`num_prompt_tokens`, and
        one of a long prompt (``short`` False, see :meth:`is_short`) lifts the step to
        ``target_ms``."""
        self.rows.append((num_new, context, samples))
        if prompt:
            self.prompt_rows.append((num_new, context, samples))
            self.num_prompt_tokens += num_new
            if not short:
                self.has_long_prompt = True

    def prompt_tokens(
        self, context: int, limit: int, remaining: int | None = None, *, short: bool = False
    ) -> int:
        """The most tokens (<= ``limit``) of a prompt at ``context`` that fit in the time
        left (to ``short_target_ms`` for a ``short`` prompt while no long one is in the
        step); a chunk that reaches ``remaining`` (the tokens left to its prompt, when
        given) finishes it and also pays one sampled row."""
        short = short and not self.has_long_prompt
        left = self._left(self.short_ms if short else self.target_ms)
        n = self.model.max_chunk(left, context, limit)
        if remaining is not None and n >= remaining > 0:
            while n > 0 and self.model.chunk_ms(n, context, True) > left:
                n -= 1  # the last chunk samples: leave room for its row
        return n


def output_rows(
    num_scheduled_tokens: Mapping[str, int],
    cached_seq_len: Mapping[str, int],
    sampled_token_ids: Mapping[str, list[int]],
    num_scheduled_tokens_padded: Mapping[str, int] | None = None,
    decode_batch_size_padded: int | None = None,
) -> list[tuple[int, int, bool]]:
    """The ``(num_new, context, samples)`` rows of an executed step from its
    SchedulerOutput's fields and the runner's sampled tokens: padded chunk sizes where
    given (padding is computed), and a padded decode batch's dummy rows as decode rows
    over no context."""
    padded = num_scheduled_tokens_padded or {}
    rows = [
        (max(n, padded.get(r, n)), cached_seq_len.get(r, 0), bool(sampled_token_ids.get(r)))
        for r, n in num_scheduled_tokens.items()
    ]
    if decode_batch_size_padded:
        num_decodes = sum(1 for n, _, _ in rows if n == 1)
        rows += [(1, 0, False)] * max(0, decode_batch_size_padded - num_decodes)
    return rows


def output_features(
    num_scheduled_tokens: Mapping[str, int],
    cached_seq_len: Mapping[str, int],
    sampled_token_ids: Mapping[str, list[int]],
    num_scheduled_tokens_padded: Mapping[str, int] | None = None,
    decode_batch_size_padded: int | None = None,
) -> Features:
    """:func:`step_features` of :func:`output_rows` (same arguments)."""
    return step_features(
        output_rows(
            num_scheduled_tokens,
            cached_seq_len,
            sampled_token_ids,
            num_scheduled_tokens_padded,
            decode_batch_size_padded,
        )
    )
