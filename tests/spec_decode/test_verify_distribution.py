"""The verifier keeps the target distribution (chi-square on a 6-token vocabulary).

The runner's path: every row sampled by the real :class:`Sampler` with the request's
rules (``draft_states``), drafts accepted while equal (``num_accepted``). The emitted
first token must follow row 0's distribution whatever the draft, and the token after
an accepted draft row 1's. :func:`rejection_sample` (a draft that is a distribution)
is checked the same way. A verifier that accepted drafts more often than ``p(d)``
fails these tests (checked by ``test_a_biased_verifier_is_caught``).
"""

from __future__ import annotations

import torch

from kvserve.request import SamplingParams
from kvserve.sampling.sampler import Sampler, SamplingRequestState
from kvserve.spec_decode import verify
from kvserve.spec_decode.verify import draft_states, draw, num_accepted, rejection_sample

V = 6
LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, 0.0, -0.5, 1.5],
        [0.0, 2.5, -1.0, 1.0, 0.3, 0.2],
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    ]
)
TEMP = 0.8
# chi-square critical values at p = 0.001 (df = 5); a correct verifier fails 1 in 1000
CRITICAL_DF5 = 20.515


def chi_square(counts: list[int], probs: torch.Tensor) -> float:
    n = sum(counts)
    expected = probs * n
    return float(sum((c - e) ** 2 / e for c, e in zip(counts, expected.tolist(), strict=True)))


def target(row: int) -> torch.Tensor:
    return torch.softmax(LOGITS[row] / TEMP, dim=-1)


def verify_once(sampler: Sampler, drafts: list[int], step: int) -> list[int]:
    base = SamplingRequestState(
        params=SamplingParams(temperature=TEMP, max_tokens=100),
        prompt_token_ids=[0],
        output_token_ids=[1] * step,
    )
    states = draft_states(base, drafts)
    tokens = sampler(LOGITS[: len(states)].clone(), states).token_ids
    return tokens[: num_accepted(tokens, drafts) + 1]


def test_runner_verifier_emits_the_target_distribution():
    sampler = Sampler(seed=7)
    first = [0] * V
    second = [0] * V
    for i in range(6000):
        out = verify_once(sampler, [0, 5], i)
        first[out[0]] += 1
        if out[0] == 0:  # draft 1 accepted: the next token is row 1's
            second[out[1]] += 1
    assert chi_square(first, target(0)) < CRITICAL_DF5
    assert sum(second) > 2000
    assert chi_square(second, target(1)) < CRITICAL_DF5


def test_rejection_sampling_with_a_draft_distribution_keeps_the_target():
    gen = torch.Generator().manual_seed(3)
    p = torch.stack([target(0), target(1), target(2)])
    q = torch.softmax(torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0, 0.0], [1.0] * V]), dim=-1)
    first = [0] * V
    for _ in range(6000):
        d0 = int(torch.multinomial(q[0], 1, generator=gen))
        d1 = int(torch.multinomial(q[1], 1, generator=gen))
        out = rejection_sample(p, [d0, d1], q, generator=gen)
        first[out[0]] += 1
    assert chi_square(first, p[0]) < CRITICAL_DF5
    one_hot = [0] * V
    for _ in range(6000):
        one_hot[rejection_sample(p, [0, 5], None, generator=gen)[0]] += 1
    assert chi_square(one_hot, p[0]) < CRITICAL_DF5


def test_a_biased_verifier_is_caught():
    # accepting the draft with probability 0.5 + p(d)/2 instead of p(d) must fail
    gen = torch.Generator().manual_seed(5)
    p0 = target(0)
    counts = [0] * V
    for _ in range(6000):
        if float(torch.rand((), generator=gen)) < 0.5 + float(p0[3]) / 2:
            counts[3] += 1
        else:
            counts[int(torch.multinomial(p0, 1, generator=gen))] += 1
    assert chi_square(counts, p0) > CRITICAL_DF5


def test_seeded_rows_draw_what_sequential_decoding_draws():
    # a seeded request: row j of a verification uses the number of output token
    # len(outputs) + j, so it samples what step-by-step decoding samples
    params = SamplingParams(temperature=TEMP, seed=99, max_tokens=100)
    sampler = Sampler()
    sequential = []
    outputs: list[int] = []
    for j in range(3):
        st = SamplingRequestState(
            params=params, prompt_token_ids=[0], output_token_ids=list(outputs)
        )
        tok = sampler(LOGITS[j : j + 1].clone(), [st]).token_ids[0]
        sequential.append(tok)
        outputs.append(tok)
    base = SamplingRequestState(params=params, prompt_token_ids=[0], output_token_ids=[])
    states = draft_states(base, sequential[:2])
    rows = sampler(LOGITS.clone(), states).token_ids
    assert rows == sequential and num_accepted(rows, sequential[:2]) == 2


DRAFT_LOGITS = torch.tensor(
    [[1.5, 1.2, 0.5, 0.2, -0.5, 1.0], [0.3, 2.0, -1.0, 1.2, 0.0, 0.5]]
)  # a draft close to the target, not equal


def test_distributions_are_what_the_sampler_draws_from(single_thread_torch):
    params = [
        SamplingParams(temperature=0.7, top_k=4, max_tokens=9),
        SamplingParams(temperature=1.3, top_p=0.8, max_tokens=9),
        SamplingParams(temperature=0.9, min_p=0.2, repetition_penalty=1.3, max_tokens=9),
    ]
    states = [SamplingRequestState(p, [0], [5, 1]) for p in params]
    sampler = Sampler(seed=11)
    probs = sampler.distributions(LOGITS.clone(), states)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert int((probs[0] > 0).sum()) == 4  # top-k 4
    counts = [[0] * V for _ in params]
    for _ in range(2000):
        for r, tok in enumerate(sampler(LOGITS.clone(), states).token_ids):
            counts[r][tok] += 1
    for r in range(3):
        keep = probs[r] > 0
        c = [n for n, k in zip(counts[r], keep.tolist(), strict=True) if k]
        assert sum(c) == 2000  # never a token outside the distribution
        df = int(keep.sum()) - 1
        critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}[df]
        assert chi_square(c, probs[r][keep]) < critical
    greedy = SamplingRequestState(SamplingParams(temperature=0.0, max_tokens=9), [0], [])
    hot = sampler.distributions(LOGITS[:1].clone(), [greedy])
    assert hot[0].tolist() == [1.0, 0, 0, 0, 0, 0]


def test_sampled_drafts_verified_against_their_q_keep_the_target_and_accept_more(
    single_thread_torch,
):
    from kvserve.spec_decode.verify import verify_sampled

    params = SamplingParams(temperature=TEMP, top_p=0.95, max_tokens=100)
    sampler = Sampler(seed=5)
    base = SamplingRequestState(params=params, prompt_token_ids=[0], output_token_ids=[])
    gen = torch.Generator().manual_seed(8)
    first = [0] * V
    second = [0] * V
    accepted = 0
    n = 4000
    q0 = sampler.distributions(DRAFT_LOGITS[:1].clone(), [base])[0]
    q1s = [
        sampler.distributions(DRAFT_LOGITS[1:2].clone(), [draft_states(base, [d])[1]])[0]
        for d in range(V)
    ]  # the draft's second row given its first draft (the same rules, no penalties)
    for _ in range(n):
        d0 = int(torch.multinomial(q0, 1, generator=gen))
        q1 = q1s[d0]
        d1 = int(torch.multinomial(q1, 1, generator=gen))
        states = draft_states(base, [d0, d1])
        out = verify_sampled(sampler, LOGITS.clone(), states, [d0, d1], torch.stack([q0, q1]))
        first[out[0]] += 1
        accepted += len(out) - 1
        if len(out) > 1:
            second[out[1]] += 1
    p = sampler.distributions(LOGITS.clone(), draft_states(base, [0, 0]))
    keep0 = p[0] > 0
    assert (
        chi_square([c for c, k in zip(first, keep0.tolist(), strict=True) if k], p[0][keep0])
        < 20.52
    )
    # the token after an accepted first draft follows row 1 (it does not depend on d0
    # here: no penalties), and acceptance is sum(min(p, q)), above p(argmax q)
    keep1 = p[1] > 0
    assert (
        chi_square([c for c, k in zip(second, keep1.tolist(), strict=True) if k], p[1][keep1])
        < 20.52
    )
    overlap = float(torch.minimum(p[0], q0).sum())
    first_accept = sum(second) / n
    assert abs(first_accept - overlap) < 0.035
    assert overlap > float(p[0][int(q0.argmax())]) + 0.1


def test_seeded_verification_is_reproducible():
    from kvserve.spec_decode.verify import verify_sampled

    params = SamplingParams(temperature=TEMP, seed=4, max_tokens=100)
    sampler = Sampler()
    base = SamplingRequestState(params=params, prompt_token_ids=[0], output_token_ids=[1, 2])
    q = torch.softmax(DRAFT_LOGITS / TEMP, dim=-1)
    runs = [
        verify_sampled(sampler, LOGITS.clone(), draft_states(base, [1, 3]), [1, 3], q)
        for _ in range(3)
    ]
    assert runs[0] == runs[1] == runs[2]


def test_draw_follows_unnormalised_weights_and_never_draws_a_zero():
    """The correction / bonus draw (inverse CDF) is exact in distribution, skips zero
    weights, and is reproducible from its generator."""
    gen = torch.Generator().manual_seed(11)
    w = torch.tensor([0.0, 3.0, 0.0, 1.0, 2.0, 0.5, 1.5, 2.0, 0.0])  # sum 10, zeros inside and last
    counts = [0] * w.shape[0]
    for _ in range(6000):
        counts[draw(w, gen)] += 1
    assert counts[0] == counts[2] == counts[8] == 0
    keep = w > 0
    kept = [c for c, k in zip(counts, keep.tolist(), strict=True) if k]
    assert chi_square(kept, w[keep] / w.sum()) < CRITICAL_DF5
    a = [draw(w, torch.Generator().manual_seed(4)) for _ in range(3)]
    b = [draw(w, torch.Generator().manual_seed(4)) for _ in range(3)]
    assert a == b


def test_draw_at_the_top_of_the_range_takes_the_last_nonzero_weight(monkeypatch):
    """A uniform number whose product with the total rounds up to the total must not
    fall off the end (nor onto trailing zero weights)."""
    monkeypatch.setattr(
        verify.torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64)
    )
    assert draw(torch.tensor([0.2, 0.0, 0.7, 0.1, 0.0, 0.0])) == 3
