"""Measured gain: does speculation pay on this machine, for this batch size, now?

The controller's cost model (:mod:`kvserve.spec_decode.controller`) plans with
estimates; whatever it gets wrong (a draft model slower than its bytes suggest, a
loaded machine, acceptance that drops with sampling, Python overhead per depth),
this monitor measures what speculation actually yields and turns it off where it
does not pay. Per pure decode step (no prompt tokens) of ``B`` requests::

    spec step:   tokens = B + accepted drafts, cost = target step + the proposing
                 time that made its drafts (the previous step's propose call)
    plain step:  tokens = B,                   cost = target step (nothing proposed)

    gain(B) = (tokens / cost over spec steps) / (B / cost over plain steps)

both as exponentially decayed sums per batch-size bucket (exact sizes up to 8, then
powers of two); a step's cost counts at most ``CLIP`` times its side's mean cost per
token (a process descheduled on a loaded machine makes single steps many times
slower, and one such step among a bucket's two plain probes or six spec steps would
flip its decision). Plain steps are rare while speculating, so every ``PROBE_EVERY``-th
spec step of a bucket is followed by a *probe*: one step with no proposals; a bucket
whose last measured gain is at least ``CONFIDENT_GAIN`` probes only every
``PROBE_EVERY_CONFIDENT``-th (a probe gives up ``1 - 1/g`` of a step's tokens, and
such a bucket turns off only if its rates move by the factor ``g``, which the decayed
spec side notices between probes as well: 3 % of a single stream's n-gram gain at
``g`` = 2.3 was spent on probes every 24 steps). Once a
bucket has ``MIN_SPEC`` spec and ``MIN_PLAIN`` plain measurements and its gain is
below 1, speculation is off for that bucket; after ``retry`` more steps it gets a
trial of ``MIN_SPEC`` spec steps again (measured afresh), and each failed trial doubles
``retry`` (up to ``MAX_RETRY``). The monitor also reports a measured draft-forward
cost (time per proposing forward over a plain step of the bucket) that the
controller plans with instead of its weight-bytes estimate. One-off costs (a draft
model's catch-up prefill of a new request) are not mixed into these rates: a decayed
window of a few steps would charge a cost that the request's whole output pays off;
:class:`~kvserve.spec_decode.decoder.SpecDecoder` weighs each catch-up against the
remaining output with :meth:`plain_step_time` and :meth:`last_gain` instead.

Rules for callers: :meth:`record` once per step with that step's numbers (an
injected clock makes it deterministic in tests); ask :meth:`allow` before proposing
for the next step (False: propose nothing). The monitor never looks at requests.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.9  # per measurement: recent steps count more (the load changes)
MIN_SPEC = 6  # spec steps measured before a bucket's gain is trusted
MIN_PLAIN = 2  # plain steps measured before a bucket's gain is trusted
PROBE_EVERY = 24  # spec steps between two plain probes
CONFIDENT_GAIN = 1.5  # a bucket measured at least this far ahead ...
PROBE_EVERY_CONFIDENT = 96  # ... probes this rarely
RETRY = 48  # steps a bucket stays off before its first retrial
MAX_RETRY = 768
CLIP = 3.0  # a step's cost per token counts at most this many times its side's mean
CLIP_AFTER = 2  # ... once the side has this many measurements


def bucket_of(batch: int) -> int:
    """Batch-size bucket: exact up to 8, then the next power of two."""
    if batch <= 8:
        return batch
    return 1 << (batch - 1).bit_length()


@dataclass
class _Rate:
    tokens: float = 0.0
    cost: float = 0.0
    n: int = 0

    def add(self, tokens: float, cost: float) -> None:
        if self.n >= CLIP_AFTER and self.tokens > 0 and tokens > 0:
            # a step many times slower per token than this side's mean is the machine
            # (the process descheduled on a loaded host), not speculation: clip it
            cost = min(cost, CLIP * tokens * self.cost / self.tokens)
        self.tokens = DECAY * self.tokens + tokens
        self.cost = DECAY * self.cost + cost
        self.n += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.cost if self.cost > 0 else 0.0


@dataclass
class _Bucket:
    spec: _Rate
    plain: _Rate
    since_probe: int = 0
    off_steps: int = 0  # > 0: off, counting down to a retrial
    retry: int = RETRY
    trial: bool = False  # measuring a retrial: decide after MIN_SPEC spec steps
    draft_forward: float = 0.0  # decayed time per proposing forward
    draft_forward_w: float = 0.0

    last_gain: float | None = None  # the last gain measured when trusted (kept in trials)

    @property
    def trusted(self) -> bool:
        return self.spec.n >= MIN_SPEC and self.plain.n >= MIN_PLAIN


class GainMonitor:
    """Realized speculative gain per batch-size bucket (see the module docstring)."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}

    def _get(self, batch: int) -> _Bucket:
        b = bucket_of(batch)
        if b not in self._buckets:
            self._buckets[b] = _Bucket(_Rate(), _Rate())
        return self._buckets[b]

    def gain(self, batch: int) -> float | None:
        """Measured gain for ``batch`` decodes (None: not measured enough yet)."""
        bk = self._buckets.get(bucket_of(batch))
        if bk is None or not bk.trusted or bk.plain.rate <= 0:
            return None
        return bk.spec.rate / bk.plain.rate

    def last_gain(self, batch: int) -> float | None:
        """The current gain if measured, else the last one measured (a retrial
        measures afresh), else None."""
        g = self.gain(batch)
        if g is not None:
            return g
        bk = self._buckets.get(bucket_of(batch))
        return bk.last_gain if bk is not None else None

    def plain_step_time(self, batch: int) -> float | None:
        """Measured seconds of a plain step of ``batch`` decodes (None: none yet)."""
        bk = self._buckets.get(bucket_of(batch))
        if bk is None or bk.plain.n < 1 or bk.plain.rate <= 0:
            return None
        return bucket_of(batch) / bk.plain.rate

    def draft_forward_cost(self, batch: int) -> float | None:
        """Measured time of one proposing forward over a plain step of ``batch``
        decodes (None: not measured yet)."""
        bk = self._buckets.get(bucket_of(batch))
        if bk is None or bk.draft_forward_w <= 0 or bk.plain.n < 1 or bk.plain.rate <= 0:
            return None
        plain_step = bucket_of(batch) / bk.plain.rate  # tokens per plain step = batch
        per_forward = bk.draft_forward / bk.draft_forward_w
        return per_forward / plain_step if plain_step > 0 else None

    def allow(self, batch: int) -> bool:
        """Whether to propose for a next step of ``batch`` decodes. Counts the call:
        an off bucket counts down to its retrial, a speculating one to its probe."""
        bk = self._get(batch)
        if bk.off_steps > 0:
            bk.off_steps -= 1
            if bk.off_steps == 0:  # retrial: measure speculation afresh
                bk.spec = _Rate()
                bk.trial = True
                bk.since_probe = 0
            return False
        sure = bk.last_gain is not None and bk.last_gain >= CONFIDENT_GAIN
        every = PROBE_EVERY_CONFIDENT if sure else PROBE_EVERY
        if bk.since_probe >= every or (bk.plain.n < MIN_PLAIN and bk.spec.n >= 1):
            bk.since_probe = 0
            return False  # a probe: the next step runs without drafts
        return True

    def record(
        self,
        batch: int,
        *,
        tokens: int,
        target_time: float,
        propose_time: float,
        num_forwards: int,
        verified: bool,
    ) -> None:
        """One pure decode step of ``batch`` requests: ``tokens`` emitted, the target
        step took ``target_time``; ``propose_time`` (``num_forwards`` proposing
        forwards) is the propose call whose drafts this step verified (0: none was
        made). ``verified``: some request verified drafts this step."""
        if batch <= 0 or target_time <= 0:
            return
        bk = self._get(batch)
        if propose_time > 0 or verified:
            bk.spec.add(tokens, target_time + propose_time)
            bk.since_probe += 1
            if num_forwards > 0 and propose_time > 0:
                bk.draft_forward = DECAY * bk.draft_forward + propose_time
                bk.draft_forward_w = DECAY * bk.draft_forward_w + num_forwards
        else:
            bk.plain.add(tokens, target_time)
        if bk.off_steps > 0 or not bk.trusted:
            return
        g = bk.spec.rate / bk.plain.rate if bk.plain.rate > 0 else 1.0
        bk.last_gain = g
        if g < 1.0:
            bk.retry = min(MAX_RETRY, bk.retry * 2) if bk.trial else bk.retry
            bk.off_steps = bk.retry
            bk.trial = False
        elif bk.trial:
            bk.trial = False
            bk.retry = RETRY
