"""The step-time cost model (kvserve.sched.cost_model) and the policies' use of it."""

from __future__ import annotations

import random

import pytest

from kvserve.config import SchedulerConfig
from kvserve.kv_cache import KVCacheManager
from kvserve.request import Request, SamplingParams
from kvserve.sched import make_scheduler
from kvserve.sched.cost_model import (
    REFIT_EVERY,
    CostModel,
    fit_coefficients,
    output_features,
    output_rows,
    prompt_features,
    row_features,
    step_features,
)
from kvserve.sched.mixed import MIN_PROMPT_TOKENS_WITH_DECODES
from kvserve.sched.output import ModelRunnerOutput
from kvserve.sched.step_builder import is_decode

TRUE = (5.0, 0.25, 2e-5, 1.5e-4, 0.3)


def synthetic_samples(coef, n=40, noise=0.0, seed=0):
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        rows = [(1, rng.randint(0, 3000), True) for _ in range(rng.randint(0, 32))]
        for _ in range(rng.randint(0, 2)):
            rows.append((rng.randint(2, 1024), rng.randint(0, 3000), rng.random() < 0.5))
        if not rows:
            rows = [(1, 10, True)]
        f = step_features(rows)
        ms = sum(c * x for c, x in zip(coef, f, strict=True))
        samples.append((f, ms * (1 + noise * rng.uniform(-1, 1))))
    return samples


def test_features_of_rows():
    assert row_features(1, 99, True) == (0.0, 1.0, 0.0, 100.0, 1.0)
    # 4 new tokens over 10 cached: pairs 4*10 + (1+2+3+4)
    assert row_features(4, 10, False) == (0.0, 4.0, 50.0, 0.0, 0.0)
    f = step_features([(1, 99, True), (4, 10, False)])
    assert f == (1.0, 5.0, 50.0, 100.0, 1.0)
    assert step_features([]) == (0.0, 0.0, 0.0, 0.0, 0.0)
    # padded chunk sizes count; padded decode rows are dummy decodes over no context
    g = output_features({"a": 3, "b": 1}, {"a": 0, "b": 7}, {"b": [5]}, {"a": 8, "b": 1}, 4)
    assert g == step_features([(8, 0, False), (1, 7, True)] + [(1, 0, False)] * 3)


def test_fit_recovers_known_coefficients():
    fitted = fit_coefficients(synthetic_samples(TRUE))
    for got, want in zip(fitted, TRUE, strict=True):
        assert got == pytest.approx(want, rel=1e-3)
    noisy = CostModel.fit(synthetic_samples(TRUE, n=200, noise=0.05, seed=1))
    for got, want in zip(noisy.coef, TRUE, strict=True):
        assert got == pytest.approx(want, rel=0.2)
    errors = [abs(noisy.predict_ms(f) - ms) / ms for f, ms in synthetic_samples(TRUE, seed=2)]
    assert max(errors) < 0.1


def test_fit_never_gives_negative_coefficients():
    # a feature that only adds noise: NNLS pins it at 0 instead of going negative
    coef = (5.0, 0.25, 2e-5, 0.0, 0.0)
    samples = synthetic_samples(coef, n=60, noise=0.02, seed=3)
    fitted = fit_coefficients(samples)
    assert all(c >= 0 for c in fitted)
    assert fitted[1] == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError, match="no samples"):
        fit_coefficients([])
    with pytest.raises(ValueError, match="must be > 0"):
        fit_coefficients([((1.0, 1.0, 0.0, 0.0, 0.0), 0.0)])


def test_budget_shrinks_with_context_and_slower_tokens():
    model = CostModel(TRUE)
    decodes = [(1, 500, True)] * 8

    def fit(m, context):
        b = m.budget(100.0)
        for n, c, s in decodes:
            b.add(n, c, s)
        return b.prompt_tokens(context, 8192, remaining=8192)

    n0, n2k, n3k = fit(model, 0), fit(model, 2500), fit(model, 3000)
    assert n0 > n2k > n3k > 0
    # each answer is the largest chunk that fits
    for ctx, n in ((0, n0), (2500, n2k)):
        rows = [*decodes, (n, ctx, False)]
        assert (
            model.predict_rows_ms(rows)
            <= 100.0
            < model.predict_rows_ms([*decodes, (n + 1, ctx, False)])
        )
    # "fp32": every token twice as expensive -> fewer tokens
    slow = CostModel((TRUE[0], 2 * TRUE[1], 2 * TRUE[2], TRUE[3], TRUE[4]))
    assert fit(slow, 0) < n0
    # nothing fits when the decodes alone exceed the target
    crowded = model.budget(10.0)
    for _ in range(64):
        crowded.add(1, 3000, True)
    assert crowded.prompt_tokens(0, 512) == 0
    # a finishing chunk also pays its sampled row
    b = model.budget(100.0)
    exact = b.prompt_tokens(0, 8192)
    assert b.prompt_tokens(0, 8192, remaining=exact) in (exact - 1, exact - 2)


def test_online_correction_moves_toward_measured_times():
    model = CostModel.fit(synthetic_samples(TRUE))
    f = step_features([(1, 100, True)] * 8 + [(256, 0, False)])
    before = model.predict_ms(f)
    for _ in range(20):
        model.observe(f, 2 * before)  # the machine got twice as slow
    assert model.predict_ms(f) > 1.7 * before
    signed = [(p - m) / m for p, m in model.errors]
    assert len(signed) == 20 and sum(signed) / len(signed) < -0.1
    # a refit on measured steps of a different machine lands near it
    truth = (3.0, 0.5, 4e-5, 3e-4, 0.1)
    fresh = CostModel.fit(synthetic_samples(TRUE, n=20))
    for feats, ms in synthetic_samples(truth, n=REFIT_EVERY * 8, seed=5):
        fresh.observe(feats, ms)
    held_out = synthetic_samples(truth, n=50, seed=6)
    errs = sorted(abs(fresh.predict_ms(x) - ms) / ms for x, ms in held_out)
    assert errs[len(errs) // 2] < 0.1
    # a fixed model records errors but does not move
    ref = CostModel.reference()
    p = ref.predict_ms(f)
    ref.observe(f, 10 * p)
    assert ref.predict_ms(f) == p and len(ref.errors) == 1


def test_prompt_rows_get_their_own_online_factor():
    """Prompt chunks beside decodes run 1.8x their fitted time while decode-only steps
    run as fitted (the server's shared-prefix trace): the prompt factor learns it
    within a few prompt steps and keeps it across the decode-only steps between two
    waves, which leave the decode predictions exact. One shared scale (prompt=None)
    would swing between the two and be wrong for both."""
    decodes = [(1, 1100, True)] * 12
    dec_f = step_features(decodes)
    mixed_rows = [*decodes, (64, 1024, True)]
    mixed_f, mixed_p = step_features(mixed_rows), prompt_features(mixed_rows)

    def truth(f, p):  # the prompt part costs 1.8x the fit, the rest as fitted
        return CostModel(TRUE).raw_ms(f) + 0.8 * CostModel(TRUE).raw_ms(p)

    for split in (True, False):
        model = CostModel.fit(synthetic_samples(TRUE))
        errs: list[tuple[float, float]] = []
        for _wave in range(3):
            for _ in range(6):
                pred = model.observe(mixed_f, truth(mixed_f, mixed_p), mixed_p if split else None)
                errs.append((pred, truth(mixed_f, mixed_p)))
            for _ in range(40):
                model.observe(dec_f, truth(dec_f, (0.0,) * 5), prompt_features(decodes))
        mixed_err = abs(model.predict_rows_ms(mixed_rows) - truth(mixed_f, mixed_p)) / truth(
            mixed_f, mixed_p
        )
        late = [abs(p - m) / m for p, m in errs[-6:]]
        if split:
            assert model.prompt_scale > 1.1  # (refits take up part of it)
            dec_err = abs(
                model.predict_ms(dec_f, prompt_features(decodes)) - truth(dec_f, (0.0,) * 5)
            )
            assert dec_err / truth(dec_f, (0.0,) * 5) < 0.05
            assert mixed_err < 0.1 and max(late) < 0.15
            # the scheduler's questions see it: a chunk costs prompt_scale times more
            assert model.chunk_ms(64, 1024, True) == pytest.approx(
                model.prompt_scale
                * CostModel(model.coef, scale=model.scale).chunk_ms(64, 1024, True)
            )
            n = model.max_chunk(30.0, 1024, 4096)
            assert model.chunk_ms(n, 1024) <= 30.0 < model.chunk_ms(n + 1, 1024)
        else:
            assert model.prompt_scale == 1.0
            assert max(late) > 0.2  # the shared scale is wrong at every new wave
    # a refit keeps the prompt factor; a decode row (n == 1) never gets it
    model.prompt_scale = 1.5
    model.refit()
    assert model.prompt_scale == 1.5 and model.scale == 1.0
    assert model.chunk_ms(1, 100, True) == model.predict_ms(row_features(1, 100, True))
    rows = output_rows({"a": 3, "b": 1}, {"a": 0, "b": 7}, {"b": [5]}, {"a": 8}, 4)
    assert step_features(rows) == output_features(
        {"a": 3, "b": 1}, {"a": 0, "b": 7}, {"b": [5]}, {"a": 8}, 4
    )
    assert prompt_features(rows) == (0.0, 8.0, 36.0, 0.0, 0.0)


# ---------------------------------------------------------------- scheduler integration

_next = [1000]


def req(req_id, prompt_len, max_tokens=64):
    tokens = list(range(_next[0], _next[0] + prompt_len))
    _next[0] += prompt_len
    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens))


def make(model, **config):
    kv = KVCacheManager(4000, 16, 8192)
    cfg = SchedulerConfig(max_model_len=8192, **config)
    sched = make_scheduler(cfg, kv)
    sched.cost_model = model
    return sched


def step(sched):
    out = sched.schedule()
    sampled = {
        r: [7]
        for r, n in out.num_scheduled_tokens.items()
        if out.cached_seq_len[r] + n == sched.requests[r].num_tokens
    }
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out, sampled


def predicted(model, out, sampled):
    return model.predict_ms(output_features(out.num_scheduled_tokens, out.cached_seq_len, sampled))


@pytest.mark.parametrize("target", [60.0, 150.0])
def test_mixed_steps_with_decodes_stay_within_the_target(target):
    model = CostModel(TRUE)
    sched = make(model, max_num_batched_tokens=4096, max_step_ms=target)
    for i in range(8):
        sched.add_request(req(f"d{i}", 32, max_tokens=200))
    first, _ = step(sched)  # no decodes yet: sized for throughput (all 8 prompts)
    assert sum(first.num_scheduled_tokens.values()) == 8 * 32
    docs = [req(f"doc{k}", 2800, max_tokens=8) for k in range(3)]
    chunk_by_context = []
    for n in range(200):
        if n % 10 == 0 and docs:
            sched.add_request(docs.pop(0))
        out, sampled = step(sched)
        decodes = [
            r
            for r in out.num_scheduled_tokens
            if r.startswith("d") and out.num_scheduled_tokens[r] == 1
        ]
        prompts = {
            r: k
            for r, k in out.num_scheduled_tokens.items()
            if r.startswith("doc") and out.cached_seq_len[r] < 2800
        }
        if decodes and prompts:
            t = predicted(model, out, sampled)
            # minimum progress rule: only a first chunk of MIN tokens may overshoot
            assert (
                t <= target * (1 + 1e-9) or sum(prompts.values()) <= MIN_PROMPT_TOKENS_WITH_DECODES
            )
            if len(prompts) == 1 and len(decodes) == 8:
                for r, k in prompts.items():
                    chunk_by_context.append((out.cached_seq_len[r], k))
        if not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    # alone beside the same 8 decodes, chunks over a longer context are smaller
    first_chunks = [k for c, k in chunk_by_context if c == 0]
    late_chunks = [k for c, k in chunk_by_context if c >= 2000]
    assert first_chunks and late_chunks and min(first_chunks) > max(late_chunks)


def test_steps_without_decodes_use_the_token_budget():
    model = CostModel(TRUE)
    sched = make(model, max_num_batched_tokens=2048, max_step_ms=20.0)
    sched.add_request(req("doc", 3000, max_tokens=4))
    out, sampled = step(sched)
    assert out.num_scheduled_tokens == {"doc": 2048}
    assert predicted(model, out, sampled) > 20.0


def test_minimum_progress_when_decodes_fill_the_target():
    model = CostModel(TRUE)
    sched = make(model, max_num_batched_tokens=2048, max_step_ms=5.0)  # < overhead + decodes
    for i in range(4):
        sched.add_request(req(f"d{i}", 16, max_tokens=50))
    step(sched)
    sched.add_request(req("doc", 1000, max_tokens=2))
    out, _ = step(sched)
    assert out.num_scheduled_tokens["doc"] == MIN_PROMPT_TOKENS_WITH_DECODES
    assert sum(1 for r in sched.running if is_decode(r)) == 4


def test_prefill_budget_with_decodes_still_bounds_tokens():
    model = CostModel((0.0, 1e-4, 0.0, 0.0, 0.0))  # nearly free: time allows everything
    sched = make(
        model, max_num_batched_tokens=2048, max_step_ms=1000.0, prefill_budget_with_decodes=256
    )
    sched.add_request(req("d0", 16, max_tokens=50))
    step(sched)
    sched.add_request(req("doc", 1000, max_tokens=2))
    out, _ = step(sched)
    assert out.num_scheduled_tokens["doc"] == 256


def test_no_cost_model_or_zero_target_means_token_budgets_only():
    for model, target in ((None, 50.0), (CostModel(TRUE), 0.0)):
        sched = make(model, max_num_batched_tokens=1024, max_step_ms=target)
        sched.add_request(req("d0", 16, max_tokens=50))
        step(sched)
        sched.add_request(req("doc", 3000, max_tokens=2))
        out, _ = step(sched)
        assert out.num_scheduled_tokens["doc"] == 1023


def test_separated_policy_picks_the_largest_bucket_that_fits():
    model = CostModel(TRUE)
    sched = make(
        model,
        scheduler_policy="separated",
        max_num_batched_tokens=2048,
        max_step_ms=150.0,
        max_num_seqs=8,
    )
    sched.add_request(req("d0", 16, max_tokens=100))
    out, _ = step(sched)  # alone: no decode waits, any bucket
    assert out.num_scheduled_tokens == {"d0": 16}
    step(sched)  # decode
    sched.add_request(req("doc", 4000, max_tokens=2))
    sizes = []
    for _ in range(40):
        out, sampled = step(sched)
        if "doc" in out.num_scheduled_tokens and out.phase == "prefill":
            padded = out.num_scheduled_tokens_padded["doc"]
            ctx = out.cached_seq_len["doc"]
            sizes.append((ctx, padded))
            t = model.predict_rows_ms([(padded, ctx, False)])
            bigger = [b for b in sched.num_batched_tokens_buckets if b > padded]
            assert t <= 150.0 or padded == sched.num_batched_tokens_buckets[0]
            if bigger and out.num_scheduled_tokens["doc"] == padded:
                assert model.predict_rows_ms([(bigger[0], ctx, False)]) > 150.0
    assert sizes and sizes[0][1] > sizes[-2][1]  # deeper into the document: smaller buckets
    # with no decode running the whole token budget is used
    alone = make(
        model, scheduler_policy="separated", max_num_batched_tokens=2048, max_step_ms=150.0
    )
    alone.add_request(req("big", 4000, max_tokens=2))
    out, _ = step(alone)
    assert out.num_scheduled_tokens == {"big": 2048}


def test_config_validates_max_step_ms():
    SchedulerConfig(max_step_ms=0).validate()
    SchedulerConfig(max_step_ms=120.5).validate()
    for bad in (-1, True, "100", 10**6):
        with pytest.raises(ValueError, match="max_step_ms"):
            SchedulerConfig(max_step_ms=bad).validate()


# ---------------------------------------------------------------- short prompts


def _decoding(sched, n):
    for i in range(n):
        sched.add_request(req(f"d{i}", 16, max_tokens=300))
    step(sched)  # prompts only: all 8 computed, they decode from now on


@pytest.mark.parametrize("short_ms", [0.0, 40.0])
def test_short_prompts_beside_decodes_fill_only_the_short_target(short_ms):
    model = CostModel(TRUE)
    sched = make(
        model, max_num_batched_tokens=2048, max_step_ms=300.0, short_prompt_step_ms=short_ms
    )
    _decoding(sched, 8)
    for k in range(10):  # each 64@0 ~16 ms of work: short when the rule is on
        sched.add_request(req(f"s{k}", 64, max_tokens=4))
    times = []
    for _ in range(40):
        out, sampled = step(sched)
        if any(r.startswith("s") and n > 1 for r, n in out.num_scheduled_tokens.items()):
            times.append(predicted(model, out, sampled))
    if short_ms:
        assert len(times) >= 5 and max(times) <= 40.0 * (1 + 1e-9)
    else:  # the old rule: every short prompt joins the first step that has room (300 ms)
        assert len(times) == 1 and times[0] > 150.0


def test_a_long_prompt_lifts_the_step_to_max_step_ms():
    model = CostModel(TRUE)
    sched = make(model, max_num_batched_tokens=2048, max_step_ms=300.0, short_prompt_step_ms=40.0)
    _decoding(sched, 8)
    sched.add_request(req("doc", 3000, max_tokens=2))  # ~750 ms of work: long
    for k in range(4):
        sched.add_request(req(f"s{k}", 64, max_tokens=4))
    out, sampled = step(sched)
    assert out.num_scheduled_tokens["doc"] > 500
    t = predicted(model, out, sampled)
    assert 150.0 < t <= 300.0 * (1 + 1e-9)


def test_budget_classifies_short_and_long_prompts():
    model = CostModel(TRUE)
    b = model.budget(300.0, 40.0)
    assert b.short_target_ms == 40.0
    assert b.is_short(0, 64) and not b.is_short(0, 1000) and not b.is_short(0, None)
    assert not b.is_short(80_000, 64)  # the same tokens over a long context cost more
    b.add(1, 10, prompt=False)
    b.add(64, 0, prompt=True, short=True)
    assert not b.has_long_prompt
    assert b.prompt_tokens(0, 2048, 64, short=True) < b.prompt_tokens(0, 2048, 64)
    b.add(256, 64, prompt=True, short=False)
    assert b.has_long_prompt
    assert b.prompt_tokens(0, 2048, 64, short=True) == b.prompt_tokens(0, 2048, 64)
    # off (0) or above the full target: one target
    assert model.budget(300.0).short_target_ms == 300.0
    assert model.budget(100.0, 400.0).short_target_ms == 100.0
    assert not model.budget(300.0, 0.0).is_short(0, 64)


def test_a_prompt_near_the_short_line_stays_short_when_predictions_move():
    """A prompt predicted a little over the short target (the online scale moved by
    10-20 %) stays short: it must not lift its step, and every stream's wait, to the
    full target; one over twice the short target is long."""
    model = CostModel(TRUE)
    b = model.budget(300.0, 40.0)
    n = next(n for n in range(1, 4096) if model.chunk_ms(n, 1024, True) > 40.0 * 1.2)
    assert b.is_short(1024, n)  # 20 % over the short target
    b.add(n // 2, 1024, prompt=True, short=b.is_short(1024, n))
    assert not b.has_long_prompt
    m = next(m for m in range(n, 1 << 16) if model.chunk_ms(m, 1024, True) > 40.0 * 2.05)
    assert not b.is_short(1024, m)


def test_config_validates_short_prompt_step_ms():
    SchedulerConfig(short_prompt_step_ms=0).validate()
    SchedulerConfig(short_prompt_step_ms=90.5).validate()
    for bad in (-1, True, "100", 10**6):
        with pytest.raises(ValueError, match="short_prompt_step_ms"):
            SchedulerConfig(short_prompt_step_ms=bad).validate()


def test_a_long_prompts_last_chunk_stays_long():
    model = CostModel(TRUE)
    sched = make(model, max_num_batched_tokens=2048, max_step_ms=300.0, short_prompt_step_ms=40.0)
    _decoding(sched, 8)
    sched.add_request(req("doc", 1200, max_tokens=2))  # ~300 ms of work: long
    out, _ = step(sched)
    left = 1200 - out.num_scheduled_tokens["doc"]
    assert 0 < left * TRUE[1] < 40.0  # what is left would be short on its own
    for k in range(4):
        sched.add_request(req(f"s{k}", 64, max_tokens=4))
    out, sampled = step(sched)
    assert out.num_scheduled_tokens["doc"] == left
    # the step stays lifted: the short prompts fill it past the short target
    assert sum(1 for r in out.num_scheduled_tokens if r.startswith("s")) == 4
    assert predicted(model, out, sampled) > 40.0


def test_short_target_leaves_prompts_half_of_a_step_with_slow_decodes():
    model = CostModel(TRUE)
    b = model.budget(300.0, 40.0)
    assert b.short_ms == 40.0
    for _ in range(16):
        b.add(1, 4000)  # 16 decodes over 4k tokens: ~28 ms with the overhead
    decode_ms = b.predicted_ms
    assert decode_ms > 20.0
    assert b.short_ms == pytest.approx(2 * decode_ms)
    n = b.prompt_tokens(0, 2048, 64, short=True)
    assert n > MIN_PROMPT_TOKENS_WITH_DECODES  # not starved to the minimum
    many = model.budget(300.0, 40.0)
    for _ in range(128):
        many.add(1, 8000)
    assert many.short_ms == 300.0  # never above the full target
