"""Sampler: each option on tiny hand-made logits, seeds, distribution sanity."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvserve.request import SamplingParams
from kvserve.sampling.sampler import (
    Sampler,
    SamplingRequestState,
    _apply_frequency_presence_penalties,
    _apply_min_p,
    _apply_repetition_penalty,
    _apply_top_k,
    _apply_top_p,
    _inverse_cdf_sample,
    seed_for_step,
    seed_uniform,
)


def state(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: int | None = None,
    **kw: object,
) -> SamplingRequestState:
    return SamplingRequestState(
        params=SamplingParams(**kw),  # type: ignore[arg-type]
        prompt_token_ids=list(prompt or [0]),
        output_token_ids=list(output or []),
        eos_token_id=eos,
    )


def log_probs_row(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


# -- greedy and the fast path ---------------------------------------------------------


def test_greedy_fast_path_is_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [5.0, 0.0, 1.0], [0.0, 0.0, 0.5]])
    out = Sampler()(logits, [state(temperature=0.0) for _ in range(3)])
    assert out.token_ids == [1, 0, 2]
    assert out.logprobs == [None, None, None]


def test_greedy_same_with_and_without_fast_path() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    fast = Sampler()(logits, [state(temperature=0.0) for _ in range(6)])
    slow_states = [state(temperature=0.0) for _ in range(5)] + [state(temperature=0.0, logprobs=0)]
    slow = Sampler()(logits, slow_states)
    assert fast.token_ids == slow.token_ids == logits.argmax(-1).tolist()


def test_input_logits_not_modified() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    before = logits.clone()
    Sampler()(logits, [state(prompt=[0], temperature=0.0, repetition_penalty=3.0)])
    assert torch.equal(logits, before)


def test_shape_mismatch_is_value_error() -> None:
    with pytest.raises(ValueError, match="do not match 2 states"):
        Sampler()(torch.zeros(3, 4), [state(), state()])


# -- penalties ------------------------------------------------------------------------


def test_repetition_penalty_exact_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0], [2.0, -1.0, 3.0, -2.0]])
    states = [
        state(prompt=[0], output=[1], repetition_penalty=2.0),
        state(prompt=[0], output=[1], repetition_penalty=1.0),  # untouched row
    ]
    _apply_repetition_penalty(logits, states)
    # Seen tokens 0 (prompt) and 1 (output): positive logits divided, negative multiplied.
    assert logits.tolist() == [[1.0, -2.0, 3.0, -2.0], [2.0, -1.0, 3.0, -2.0]]


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0], [2.0, 1.9, -1.0]])
    out = Sampler()(
        logits,
        [
            state(prompt=[0], temperature=0.0, repetition_penalty=1.2),
            state(prompt=[0], temperature=0.0),
        ],
    )
    assert out.token_ids == [1, 0]  # 2.0 / 1.2 = 1.67 < 1.9


def test_frequency_and_presence_exact_values() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    states = [
        state(prompt=[2, 2], output=[0, 0, 0, 1], frequency_penalty=0.5),
        state(prompt=[2, 2], output=[0, 0, 0, 1], presence_penalty=0.25),
        state(prompt=[2, 2], output=[0, 0, 0, 1], frequency_penalty=0.5, presence_penalty=-0.5),
    ]
    _apply_frequency_presence_penalties(logits, states)
    # Prompt tokens (2) are not penalized; counts over output: token0 x3, token1 x1.
    assert logits.tolist() == [[-0.5, 0.5, 1.0], [0.75, 0.75, 1.0], [0.0, 1.0, 1.0]]


def test_frequency_penalty_changes_greedy_choice_only_for_its_row() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])
    out = Sampler()(
        logits,
        [
            state(output=[0, 0], temperature=0.0, frequency_penalty=0.1),  # 1.0 - 0.2 = 0.8
            state(output=[0, 0], temperature=0.0),
        ],
    )
    assert out.token_ids == [1, 0]


def test_presence_penalty_ignores_prompt_tokens() -> None:
    logits = torch.tensor([[1.0, 0.9], [1.0, 0.9]])
    out = Sampler()(
        logits,
        [
            state(prompt=[0, 0, 0], temperature=0.0, presence_penalty=2.0),
            state(prompt=[1], output=[0], temperature=0.0, presence_penalty=0.15),
        ],
    )
    assert out.token_ids == [0, 1]


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 4)
    out = Sampler()(
        logits,
        [
            state(eos=0, temperature=0.0, min_tokens=2, stop_token_ids=[1]),  # 0 and 1 banned
            state(eos=0, output=[3, 3], temperature=0.0, min_tokens=2),  # min reached
            state(eos=0, temperature=0.0, min_tokens=2, ignore_eos=True),  # EOS allowed
            state(eos=0, temperature=0.0, min_tokens=2),  # only EOS banned
        ],
    )
    assert out.token_ids == [2, 0, 0, 1]


# -- truncation: min-p, top-k, top-p --------------------------------------------------


def test_min_p_exact_mask() -> None:
    row = log_probs_row(0.5, 0.3, 0.15, 0.05)
    logits = torch.tensor([row, row, row])
    out = _apply_min_p(logits, torch.tensor([0.2, 0.5, 0.0]))
    kept = torch.isfinite(out).tolist()
    assert kept == [
        [True, True, True, False],  # threshold 0.1
        [True, True, False, False],  # threshold 0.25
        [True, True, True, True],
    ]


def test_top_k_exact_mask_and_ties() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 1.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    out = _apply_top_k(logits, torch.tensor([2, 2, 4]))
    assert torch.isfinite(out).tolist() == [
        [False, False, True, True],
        [False, True, True, True],  # tie at the k-th value is kept
        [True, True, True, True],  # k >= V: off
    ]
    assert out[0, 3].item() == 3.0


def test_top_p_exact_mask() -> None:
    row = [0.05, 0.5, 0.15, 0.3]
    probs = torch.tensor([row, row, row, row])
    out = _apply_top_p(probs, torch.tensor([0.75, 0.85, 0.01, 1.0]))
    assert (out > 0).tolist() == [
        [False, True, False, True],  # 0.5 + 0.3 >= 0.75
        [False, True, True, True],  # 0.5 + 0.3 + 0.15 >= 0.85
        [False, True, False, False],  # the top token always survives
        [True, True, True, True],
    ]
    # Kept probabilities are unchanged, in their original positions.
    assert out[0, 1] == probs[0, 1] and out[0, 3] == probs[0, 3]


def test_top_p_ties_at_the_boundary_are_kept() -> None:
    out = _apply_top_p(torch.tensor([[0.4, 0.2, 0.2, 0.2]]), torch.tensor([0.5]))
    assert (out > 0).tolist() == [[True, True, True, True]]


def _reference_top_p_keep(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Sort-based nucleus in float64 (distinct probabilities assumed)."""
    values, order = probs.double().sort(descending=True)
    keep_sorted = (values.cumsum(0) - values) < p
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


def test_top_p_wide_nucleus_falls_back_to_the_whole_row() -> None:
    # 1000 distinct, nearly flat probabilities: the nucleus is far wider than 256.
    wide = torch.softmax(torch.linspace(0.0, 0.5, 1000), dim=0)
    narrow = torch.softmax(torch.linspace(0.0, 30.0, 1000), dim=0)
    probs = torch.stack([wide, narrow, wide])
    out = _apply_top_p(probs, torch.tensor([0.9, 0.9, 1.0]))
    expected_wide = _reference_top_p_keep(wide, 0.9)
    assert 800 < int(expected_wide.sum()) < 950
    assert torch.equal(out[0] > 0, expected_wide)
    assert torch.equal(out[1] > 0, _reference_top_p_keep(narrow, 0.9))
    assert torch.equal(out[2], wide)
    # A row's nucleus does not depend on the rows around it.
    assert torch.equal(_apply_top_p(wide.unsqueeze(0), torch.tensor([0.9]))[0], out[0])


def test_top_k_then_top_p_renormalizes_after_top_k() -> None:
    logits = torch.tensor([log_probs_row(0.4, 0.3, 0.2, 0.1)])
    # After top-k=3 the mass is 0.4/0.9, 0.3/0.9, 0.2/0.9; p=0.7 needs 0.444+0.333.
    probs = torch.softmax(_apply_top_k(logits, torch.tensor([3])), dim=-1)
    out = _apply_top_p(probs, torch.tensor([0.7]))
    assert (out > 0).tolist() == [[True, True, False, False]]
    sampled = Sampler(seed=0)(
        logits.expand(300, 4), [state(top_k=3, top_p=0.7) for _ in range(300)]
    ).token_ids
    assert set(sampled) == {0, 1}


def test_inverse_cdf_sample_exact_boundaries() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9999, 1.0])
    # u = 1.0 (a rounding artifact) still lands on a token with mass, never on a zero.
    assert _inverse_cdf_sample(probs, u).tolist() == [1, 1, 3, 3, 3]
    # Unnormalized rows work the same.
    assert _inverse_cdf_sample(probs * 4, u).tolist() == [1, 1, 3, 3, 3]


def test_sampled_tokens_stay_inside_the_truncated_set() -> None:
    row = log_probs_row(0.05, 0.5, 0.15, 0.3)
    n = 400
    logits = torch.tensor([row] * n)
    sampler = Sampler(seed=1)
    by_top_k = set(sampler(logits, [state(top_k=2) for _ in range(n)]).token_ids)
    by_top_p = set(sampler(logits, [state(top_p=0.75) for _ in range(n)]).token_ids)
    by_min_p = set(sampler(logits, [state(min_p=0.5) for _ in range(n)]).token_ids)
    assert by_top_k == {1, 3}
    assert by_top_p == {1, 3}
    assert by_min_p == {1, 3}  # threshold 0.25


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 300, generator=gen) * 3
    greedy = logits.argmax(-1).tolist()
    sampler = Sampler(seed=2)
    assert sampler(logits, [state(temperature=1.5, top_k=1) for _ in range(64)]).token_ids == greedy
    assert sampler(logits, [state(temperature=1.5, top_p=1e-6) for _ in range(64)]).token_ids == (
        greedy
    )
    assert sampler(logits, [state(temperature=1e-7) for _ in range(64)]).token_ids == greedy


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [(1.0, [0.6, 0.3, 0.1]), (0.5, [0.36 / 0.46, 0.09 / 0.46, 0.01 / 0.46])],
)
def test_temperature_sampling_frequencies(temperature: float, expected: list[float]) -> None:
    n = 4000
    logits = torch.tensor([log_probs_row(0.6, 0.3, 0.1)] * n)
    out = Sampler(seed=123)(logits, [state(temperature=temperature) for _ in range(n)])
    counts = Counter(out.token_ids)
    for tok, p in enumerate(expected):
        # 5 standard deviations of a binomial proportion: fails only if the law is wrong.
        assert abs(counts[tok] / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_seeded_frequencies_follow_the_distribution() -> None:
    # Different (seed, step) pairs must look like independent draws.
    logits = torch.tensor([log_probs_row(0.7, 0.2, 0.1)])
    n = 1500
    sampler = Sampler()
    tokens = [sampler(logits, [state(seed=s, output=[5] * (s % 7))]).token_ids[0] for s in range(n)]
    counts = Counter(tokens)
    for tok, p in enumerate([0.7, 0.2, 0.1]):
        assert abs(counts[tok] / n - p) < 5 * math.sqrt(p * (1 - p) / n)


# -- seeds ----------------------------------------------------------------------------


def _seeded_run(
    position: int, others: list[SamplingRequestState], others_logits: torch.Tensor
) -> list[int]:
    """Generate 12 tokens for a seeded request placed at ``position`` in the batch."""
    vocab = others_logits.shape[1]
    target_logits = torch.linspace(0.0, 1.0, vocab)  # nearly flat: any change shows
    target = state(seed=42, temperature=1.0, top_p=0.95)
    tokens = []
    sampler = Sampler()
    for _ in range(12):
        rows = [others_logits[i] for i in range(len(others))]
        rows.insert(position, target_logits)
        states = list(others)
        states.insert(position, target)
        out = sampler(torch.stack(rows), states)
        tok = out.token_ids[position]
        tokens.append(tok)
        target.output_token_ids.append(tok)
    return tokens


def test_seed_reproducible_across_batch_composition_and_position() -> None:
    vocab = 500
    gen = torch.Generator().manual_seed(7)
    base = _seeded_run(0, [], torch.zeros(0, vocab))
    others = [
        state(temperature=0.0),
        state(temperature=0.8, top_k=5),
        state(seed=1, temperature=1.0, min_p=0.1),
        state(temperature=1.0, repetition_penalty=1.3, logprobs=3),
    ]
    other_logits = torch.randn(len(others), vocab, generator=gen)
    assert _seeded_run(2, others, other_logits) == base
    assert _seeded_run(4, others, other_logits) == base
    assert _seeded_run(1, others[:1], other_logits[:1]) == base
    assert len(set(base)) > 6  # the request really samples (flat logits)


def test_seed_depends_on_step_and_seed_only() -> None:
    logits = torch.zeros(1, 1000)
    sampler = Sampler()
    first = sampler(logits, [state(seed=9, output=[1, 2, 3])]).token_ids
    # After a preemption the runner rebuilds the state: same outputs, same draw.
    again = sampler(logits, [state(seed=9, prompt=[4, 4], output=[7, 8, 9])]).token_ids
    assert first == again
    steps = {sampler(logits, [state(seed=9, output=[0] * k)]).token_ids[0] for k in range(20)}
    seeds = {sampler(logits, [state(seed=s, output=[1, 2, 3])]).token_ids[0] for s in range(20)}
    assert len(steps) > 10 and len(seeds) > 10


def test_seed_for_step_is_stable_and_spread() -> None:
    values = {seed_for_step(s, k) for s in range(-5, 30) for k in range(30)}
    assert len(values) == 35 * 30
    assert all(0 <= v < 2**63 for v in values)
    uniforms = [seed_uniform(s, k) for s in range(40) for k in range(50)]
    assert all(0.0 <= u < 1.0 for u in uniforms)
    assert abs(sum(uniforms) / len(uniforms) - 0.5) < 0.02
    # Pinned: a changed mix would change every seeded user's outputs.
    assert seed_for_step(42, 7) == 7226620547501006199
    assert seed_uniform(42, 7) == (7226620547501006199 >> 10) / 2.0**53


def test_unseeded_sampler_seed_makes_runs_repeatable() -> None:
    logits = torch.zeros(8, 100)
    states = [state() for _ in range(8)]
    assert Sampler(seed=5)(logits, states).token_ids == Sampler(seed=5)(logits, states).token_ids


# -- logprobs -------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax() -> None:
    row = log_probs_row(0.5, 0.25, 0.125, 0.125)
    logits = torch.tensor([row, row, row]) + 3.0  # a shift must not matter
    out = Sampler()(
        logits,
        [
            state(temperature=0.0, logprobs=0),
            state(temperature=0.0, logprobs=2, prompt=[0], repetition_penalty=5.0),
            state(temperature=0.0),
        ],
    )
    assert out.token_ids == [0, 1, 0]
    lp0, lp1, lp2 = out.logprobs
    assert lp2 is None
    assert lp0 is not None and lp0.top_token_ids == [] and lp0.top_logprobs == []
    assert lp0.sampled_logprob == pytest.approx(math.log(0.5), abs=1e-6)
    # The penalty changed the choice, not the reported (raw) logprobs.
    assert lp1 is not None
    assert lp1.sampled_logprob == pytest.approx(math.log(0.25), abs=1e-6)
    assert lp1.top_token_ids == [0, 1]
    assert lp1.top_logprobs == pytest.approx([math.log(0.5), math.log(0.25)], abs=1e-6)


def test_logprobs_with_temperature_report_model_distribution() -> None:
    row = log_probs_row(0.9, 0.1)
    out = Sampler(seed=0)(torch.tensor([row] * 50), [state(temperature=2.0, logprobs=1)] * 50)
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp is not None
        assert lp.sampled_logprob == pytest.approx(row[tok], abs=1e-6)
        assert lp.top_token_ids == [0]


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_native_top_p_and_draw_match_portable(
    monkeypatch: pytest.MonkeyPatch, top_p: float
) -> None:
    """The native nucleus selection and draw agree with the portable torch path."""
    from kvserve.model.kernels.backend import default_backend
    from kvserve.sampling.sampler import _inverse_cdf_sample

    kernel = default_backend().sampling
    assert kernel is not None, "the test machine has a C++ compiler"
    gen = torch.Generator().manual_seed(int(top_p * 1000))
    logits = torch.randn(40, 3000, generator=gen) * torch.linspace(0.5, 6.0, 40).unsqueeze(1)
    probs = torch.softmax(logits, -1)
    probs[3, 100:110] = probs[3, 5]  # ties
    p = torch.full((40,), top_p)
    p[7] = 1.0  # a row without top-p
    native = _apply_top_p(probs, p, kernel)
    uniforms = torch.rand(40, dtype=torch.float64, generator=gen)
    drawn = kernel.sample_rows(probs, kernel.top_p_threshold(probs, p), uniforms)
    portable = _apply_top_p(probs, p)
    assert torch.equal(native > 0, portable > 0)
    assert torch.equal(drawn, _inverse_cdf_sample(portable, uniforms))
    assert torch.equal(kernel.argmax_rows(logits), logits.argmax(-1))
    temps = torch.linspace(0.3, 1.7, 40)
    torch.testing.assert_close(
        kernel.softmax_rows(logits[:, :2999].contiguous(), 1.0 / temps),  # a vector tail
        torch.softmax(logits[:, :2999] / temps.unsqueeze(1), -1),
        atol=1e-6,
        rtol=1e-4,
    )


# ---------------------------------------------------------------- logit_bias, token masks


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 2)
    states = [
        state(temperature=0.0, logit_bias={3: 100.0}),
        state(temperature=0.0, logit_bias={0: -100.0}),
    ]
    out = Sampler()(logits, states)
    assert out.token_ids == [3, 1]
    # sampled rows: a -100 bias makes a token (practically) never drawn
    sampler = Sampler(seed=0)
    draws = [
        sampler(torch.zeros(1, 4), [state(temperature=1.0, logit_bias={1: -100.0})]).token_ids[0]
        for _ in range(200)
    ]
    assert 1 not in draws and set(draws) == {0, 2, 3}
    # logprobs stay the model's own (before the bias)
    out = Sampler()(logits[:1], [state(temperature=0.0, logprobs=0, logit_bias={3: 100.0})])
    assert out.logprobs[0] is not None
    assert out.logprobs[0].sampled_logprob == pytest.approx(
        torch.log_softmax(logits[0], -1)[3].item(), abs=1e-5
    )


def test_token_mask_restricts_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]] * 2)
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    out = Sampler()(logits, [state(temperature=0.0), state(temperature=0.0)], token_mask=mask)
    assert out.token_ids == [2, 0]
    sampler = Sampler(seed=1)
    only = torch.tensor([[False, True, False, True]])
    draws = {
        sampler(torch.zeros(1, 4), [state(temperature=1.0)], token_mask=only).token_ids[0]
        for _ in range(100)
    }
    assert draws == {1, 3}


def test_token_mask_wins_over_min_tokens() -> None:
    # the grammar allows only EOS (3) while min_tokens bans it: the mask decides
    mask = torch.tensor([[False, False, False, True]])
    out = Sampler()(
        torch.zeros(1, 4), [state(eos=3, temperature=0.0, min_tokens=5)], token_mask=mask
    )
    assert out.token_ids == [3]


def test_native_argmax_matches_torch_on_ties_nans_infs_and_odd_widths() -> None:
    from kvserve.model.kernels.backend import default_backend

    kernel = default_backend().sampling
    if kernel is None:
        pytest.skip("native kernels not built here")
    gen = torch.Generator().manual_seed(0)
    for cols in (1, 7, 16, 17, 33, 100, 49152):
        x = torch.randn(9, cols, generator=gen)
        x[1] = 0.0  # all ties: the first
        x[2, cols // 2 :] = float("-inf")
        x[3] = float("-inf")
        x[4, -1] = float("nan")  # a NaN wins, even after the maximum
        x[5, cols // 3] = float("inf")
        x[6, :] = -0.0
        x[6, -1] = 0.0  # -0.0 == 0.0: still the first
        x[7, cols // 2] = x[7].max() + 1
        x[7, -1] = x[7, cols // 2]  # a tie with the maximum: the first
        if cols > 1:
            x[8, 0], x[8, 1] = float("nan"), float("nan")
        assert kernel.argmax_rows(x).tolist() == x.argmax(-1).tolist(), cols


def test_native_draw_and_softmax_match_portable_on_wide_rows() -> None:
    """Draws over 256 rows of a 49,157-token vocabulary (blocks of 16 plus a tail, most
    mass spread wide, one row zero past a cut-off, one with a threshold) equal the
    portable inverse CDF, and the vectorized softmax matches torch's."""
    from kvserve.model.kernels.backend import default_backend
    from kvserve.sampling.sampler import _inverse_cdf_sample

    kernel = default_backend().sampling
    assert kernel is not None, "the test machine has a C++ compiler"
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(256, 49157, generator=gen) * 3
    temps = torch.full((256,), 0.8)
    probs = kernel.softmax_rows(logits, 1.0 / temps)
    torch.testing.assert_close(probs, torch.softmax(logits / 0.8, -1), atol=1e-7, rtol=1e-4)
    probs[5, 1000:] = 0.0
    threshold = torch.zeros(256)
    threshold[9] = float(probs[9].quantile(0.99))
    uniforms = torch.rand(256, dtype=torch.float64, generator=gen)
    uniforms[:4] = torch.tensor([0.0, 1.0 - 1e-12, 0.5, 1e-9], dtype=torch.float64)
    drawn = kernel.sample_rows(probs, threshold, uniforms)
    kept = torch.where(probs >= threshold[:, None], probs, torch.zeros(()))
    assert torch.equal(drawn, _inverse_cdf_sample(kept.double(), uniforms))
    assert int(drawn[5]) < 1000 and float(probs[9, int(drawn[9])]) >= float(threshold[9])


# -- allowed_token_ids and bad words (vLLM's) ------------------------------------------


def test_allowed_token_ids_and_bad_words() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]] * 3)
    states = [
        state(temperature=0.0, allowed_token_ids=[2, 4]),
        state(temperature=0.0, output=[3], bad_words_token_ids=[[0], [3, 1]]),
        state(temperature=0.0, output=[2], bad_words_token_ids=[[3, 1]]),
    ]
    out = Sampler()(logits, states)
    # row 0: only 2 and 4 allowed -> 2; row 1: 0 banned, 1 banned after 3 -> 2;
    # row 2: the two-token word's prefix is not the output's tail -> argmax 0
    assert out.token_ids == [2, 2, 0]
    for _ in range(20):  # sampled rows never leave the allowed set
        s = Sampler()(logits[:1], [state(temperature=1.0, allowed_token_ids=[3, 4])])
        assert s.token_ids[0] in (3, 4)
