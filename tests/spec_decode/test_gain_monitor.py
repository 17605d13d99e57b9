"""The measured-gain rule (kvserve.spec_decode.gain) through SpecDecoder, with an
injected clock and a fake proposer: speculation turns itself off in a batch-size
bucket where the measured tokens per second fall below those of plain steps (whatever
the cause: a slow proposer, rejected drafts), comes back for bounded retrials, and
stays on where it pays (apart from its plain probes)."""

from __future__ import annotations

from types import SimpleNamespace

from kvserve.spec_decode import gain as gain_mod
from kvserve.spec_decode.decoder import SpecDecoder
from kvserve.speculative_config import SpeculativeConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeProposer:
    """Proposes ``k`` tokens per request; each of its ``max(k)`` forwards costs
    ``cost`` seconds of the clock."""

    def __init__(self, clock: Clock, cost: float, step_cost: float = 0.0) -> None:
        self.clock, self.cost, self.step_cost = clock, cost, step_cost
        self.calls = 0

    def propose(self, req_ids, token_ids, num_tokens, states=None):
        self.calls += 1
        self.clock.now += self.cost * max(num_tokens)
        return [[1] * k for k in num_tokens]

    def draft_probs(self, req_id, drafts):
        return None

    def drop(self, req_id):
        pass


def sched_out(req_ids: list[str], drafts: dict[str, list[int]], new: bool = False):
    n = {r: 1 + len(drafts.get(r, [])) for r in req_ids}
    return SimpleNamespace(
        scheduled_spec_decode_tokens={r: d for r, d in drafts.items() if r in n},
        num_scheduled_tokens=n,
        total_num_scheduled_tokens=sum(n.values()),
        scheduled_new_reqs=[object()] if new else [],
        forks={},
    )


def simulate(dec: SpecDecoder, clock: Clock, steps: int, batch: int, accept: int, step_t=1.0):
    """``steps`` decode steps of ``batch`` requests; each verified draft has its
    first ``accept`` tokens accepted. Returns, per step, whether drafts were verified."""
    reqs = [f"r{i}" for i in range(batch)]
    drafts: dict[str, list[int]] = {}
    verified: list[bool] = []
    for _ in range(steps):
        dec.begin_step(sched_out(reqs, drafts))
        clock.now += step_t * (1.0 + 0.05 * sum(len(d) for d in drafts.values()))
        for r, d in drafts.items():
            dec.observe(r, len(d), min(accept, len(d)))
        verified.append(bool(drafts))
        drafts = dec.propose(reqs, [[0, 1, 2]] * batch)
    return verified


def decoder(clock: Clock, proposer: FakeProposer) -> SpecDecoder:
    config = SpeculativeConfig.from_value(
        {"method": "ngram", "num_speculative_tokens": 3, "step_cost_per_token": 0.05}
    )
    dec = SpecDecoder(config, proposer, clock=clock)
    dec.controller.draft_step_cost = 0.0  # plan by acceptance alone: the monitor decides
    return dec


def test_speculation_turns_off_when_the_measured_gain_is_below_one():
    clock = Clock()
    proposer = FakeProposer(clock, cost=1.5)  # proposing costs more than it yields
    dec = decoder(clock, proposer)
    # all drafts accepted: the acceptance-based controller alone would keep drafting
    simulate(dec, clock, 12, batch=2, accept=3)
    g = dec.gain.gain(2)
    assert g is not None and g < 1.0
    assert dec.gain._get(2).off_steps > 0
    calls = proposer.calls
    verified = simulate(dec, clock, dec.gain._get(2).off_steps - 1, batch=2, accept=3)
    assert not any(verified) and proposer.calls == calls  # off: no proposing cost at all
    # another batch size is measured on its own
    assert dec.gain._get(1).off_steps == 0


def test_off_bucket_retries_and_backs_off():
    clock = Clock()
    proposer = FakeProposer(clock, cost=1.5)
    dec = decoder(clock, proposer)
    simulate(dec, clock, 12, batch=1, accept=3)
    assert dec.gain._get(1).off_steps > 0
    first_retry = dec.gain._get(1).retry
    calls = proposer.calls
    simulate(dec, clock, dec.gain._get(1).off_steps + 2 * gain_mod.MIN_SPEC + 4, 1, 3)
    assert proposer.calls > calls
    # it retried (proposed again), failed again and now waits twice as long
    assert dec.gain._get(1).off_steps > 0
    assert dec.gain._get(1).retry == 2 * first_retry


def test_speculation_stays_on_where_it_pays_apart_from_probes():
    clock = Clock()
    proposer = FakeProposer(clock, cost=0.03)
    dec = decoder(clock, proposer)
    verified = simulate(dec, clock, 200, batch=4, accept=3)
    g = dec.gain.gain(4)
    assert g is not None and g > 1.5
    assert dec.gain._get(4).off_steps == 0
    plain = verified[20:].count(False)
    assert 0 < plain <= len(verified[20:]) // gain_mod.PROBE_EVERY + 1  # only the probes


def test_rejected_drafts_turn_a_free_proposer_off_too():
    clock = Clock()
    proposer = FakeProposer(clock, cost=0.0)
    dec = decoder(clock, proposer)
    dec.controller.adaptive = False  # the per-request rule off: only the monitor acts
    simulate(dec, clock, 30, batch=1, accept=0)
    assert dec.gain._get(1).off_steps > 0  # verifying 3 rejected drafts costs 15 % for nothing


def test_measured_draft_forward_cost_feeds_the_controller():
    clock = Clock()
    proposer = FakeProposer(clock, cost=0.3, step_cost=0.1)
    dec = decoder(clock, proposer)
    simulate(dec, clock, 12, batch=1, accept=3)
    measured = dec.gain.draft_forward_cost(1)
    assert measured is not None and abs(measured - 0.3) < 1e-9
    assert abs(dec.controller.draft_step_cost - 0.3 * (1 + 0.05)) < 1e-9


def test_steps_with_prompt_work_are_not_measured():
    clock = Clock()
    dec = decoder(clock, FakeProposer(clock, cost=5.0))
    for _ in range(30):
        dec.begin_step(sched_out(["a"], {}, new=True))
        clock.now += 1.0
        dec.propose(["a"], [[0, 1]])
    assert dec.gain.gain(1) is None and dec.gain._get(1).off_steps == 0


class CatchingUp(FakeProposer):
    """A draft-model-like proposer: ``lag[r]`` tokens to prefill before ``r`` can
    propose, at ``per_token`` seconds each (measured once ``per_token`` is set)."""

    def __init__(self, clock: Clock, cost: float, lag: dict[str, int], per_token):
        super().__init__(clock, cost, step_cost=0.1)
        self.lag, self.per_token = lag, per_token
        self.asked: list[list[int]] = []

    def catch_up_tokens(self, req_id, history):
        return self.lag.get(req_id, 0)

    def prefill_seconds_per_token(self):
        return self.per_token

    def propose(self, req_ids, token_ids, num_tokens, states=None):
        self.asked.append(list(num_tokens))
        return super().propose(req_ids, token_ids, num_tokens, states)


def state(max_tokens: int, outputs: int):
    from kvserve.request import SamplingParams
    from kvserve.sampling.sampler import SamplingRequestState

    st = SamplingRequestState(SamplingParams(temperature=0.0, max_tokens=max_tokens), [1], [])
    st.output_token_ids = [2] * outputs
    return st


def test_a_catch_up_starts_only_where_the_remaining_output_pays_for_it():
    clock = Clock()
    # 300 tokens to prefill at 0.01 s: 3 s, i.e. 3 plain steps of 1 s
    prop = CatchingUp(clock, cost=0.03, lag={"short": 300, "long": 300, "ready": 0}, per_token=0.01)
    dec = decoder(clock, prop)
    reqs = ["short", "long", "ready"]
    sts = [state(100, 90), state(1000, 10), state(100, 90)]
    # no plain step measured yet: catch-ups wait (the next plain step measures it)
    dec.propose(reqs, [[0, 1]] * 3, sts)
    assert prop.asked[-1][0] == 0 and prop.asked[-1][1] == 0 and prop.asked[-1][2] > 0
    for _ in range(3):  # plain steps of 3 decodes, 1 s each
        dec.gain.record(
            3, tokens=3, target_time=1.0, propose_time=0.0, num_forwards=0, verified=False
        )
    assert abs(dec.gain.plain_step_time(3) - 1.0) < 1e-9
    # gain estimate (nothing measured at any batch size): the cost model, > 1 here
    assert dec._expected_gain(3, 3) > 1.2
    plan = [3, 3, 3]
    dec._refuse_unpaid_catch_ups(reqs, [[0, 1]] * 3, sts, plan)
    # short: 10 tokens left save at most 10 * 1/3 s < 1.5 * 3 s; long: 990 tokens do
    assert plan[0] == 0 and plan[1] == 3 and plan[2] == 3
    # a measured gain below 1 (also from a smaller bucket) refuses every catch-up
    bk = dec.gain._get(2)
    bk.last_gain = 0.9
    plan = [3, 3, 3]
    dec._refuse_unpaid_catch_ups(reqs, [[0, 1]] * 3, sts, plan)
    assert plan == [0, 0, 3]  # the caught-up request still proposes
    # the prefill cost not measured yet: the first chunk goes ahead and measures it
    prop.per_token = None
    plan = [3, 3, 3]
    dec._refuse_unpaid_catch_ups(reqs, [[0, 1]] * 3, sts, plan)
    assert plan == [3, 3, 3]


def test_catch_up_costs_are_not_mixed_into_the_measured_gain():
    clock = Clock()

    class Costly(FakeProposer):
        def propose(self, req_ids, token_ids, num_tokens, states=None):
            self.last_catch_up_time = 4.0  # a new request's draft prefill every call
            self.clock.now += 4.0
            return super().propose(req_ids, token_ids, num_tokens, states)

    dec = decoder(clock, Costly(clock, cost=0.03))
    simulate(dec, clock, 12, batch=2, accept=3)
    g = dec.gain.gain(2)
    assert g is not None and g > 1.5  # the steps pay; catch-ups are judged per request
    # the proposal forwards alone are what the controller's depth plan is charged
    assert abs(dec.gain.draft_forward_cost(2) - 3 * 0.03) < 1e-9  # one call of 3 forwards


def test_one_descheduled_step_does_not_turn_a_paying_bucket_off():
    clock = Clock()
    dec = decoder(clock, FakeProposer(clock, cost=0.03))
    simulate(dec, clock, 10, batch=1, accept=3)
    assert dec.gain._get(1).off_steps == 0 and dec.gain.gain(1) > 1.5
    # one spec step 30x slower (the process was not running): clipped, still on
    dec.gain.record(1, tokens=4, target_time=40.0, propose_time=0.1, num_forwards=1, verified=True)
    assert dec.gain._get(1).off_steps == 0 and dec.gain.gain(1) > 1.0
    # a real slowdown, step after step, still turns it off
    for _ in range(30):
        dec.gain.record(
            1, tokens=4, target_time=8.0, propose_time=0.1, num_forwards=1, verified=True
        )
    assert dec.gain._get(1).off_steps > 0


def test_probes_are_sparse_where_the_gain_is_large_and_frequent_where_it_is_marginal():
    clock = Clock()
    dec = decoder(clock, FakeProposer(clock, cost=0.03))
    verified = simulate(dec, clock, 400, batch=4, accept=3)
    assert dec.gain.gain(4) > gain_mod.CONFIDENT_GAIN
    plain = verified[40:].count(False)
    assert 0 < plain <= len(verified[40:]) // (2 * gain_mod.PROBE_EVERY)  # half as many, or fewer
    # marginal: each draft row costs a fifth of a step, one draft a step accepted
    clock = Clock()
    dec = decoder(clock, FakeProposer(clock, cost=0.0))
    reqs = ["a"]
    drafts: dict[str, list[int]] = {}
    verified = []
    for _ in range(400):
        dec.begin_step(sched_out(reqs, drafts))
        clock.now += 1.0 + 0.2 * sum(len(d) for d in drafts.values())
        for r, d in drafts.items():
            dec.observe(r, len(d), min(1, len(d)))
        verified.append(bool(drafts))
        drafts = dec.propose(reqs, [[0, 1, 2]])
    g = dec.gain.gain(1)
    assert g is not None and 1.0 < g < gain_mod.CONFIDENT_GAIN
    plain = verified[40:].count(False)
    assert plain >= len(verified[40:]) // (gain_mod.PROBE_EVERY + 1) - 1
