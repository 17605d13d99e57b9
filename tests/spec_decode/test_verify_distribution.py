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
from kvserve.spec_decode.verify import draft_states, num_accepted, rejection_sample
from kvserve.worker.sampler import Sampler, SamplingRequestState

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
