"""N-gram lookup, the config parser and the controller's never-worse rule."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.engine.args import build_engine_config
from kvserve.spec_decode.controller import PROBE_EVERY, SpecController
from kvserve.spec_decode.decoder import History, SpecDecoder
from kvserve.spec_decode.ngram import INDEX_MAX_N, NgramProposer, ngram_lookup
from kvserve.speculative_config import SpeculativeConfig


def lookup(tokens: list[int], lo: int = 1, hi: int = 4, k: int = 3) -> list[int]:
    return ngram_lookup(np.array(tokens, dtype=np.int64), lo, hi, k)


def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    #        a  b  c  X  Y  Z  .. a  b  c  -> X Y Z
    assert lookup([1, 2, 3, 7, 8, 9, 5, 1, 2, 3]) == [7, 8, 9]
    # the most recent occurrence wins: "2 3" followed by 4 later than by 7
    assert lookup([2, 3, 7, 0, 2, 3, 4, 6, 2, 3], lo=2, hi=2, k=1) == [4]
    # a longer match beats a more recent shorter one
    assert lookup([1, 2, 3, 9, 0, 3, 8, 1, 2, 3], lo=1, hi=3, k=1) == [9]
    # proposals stop at the end of the history
    assert lookup([5, 6, 5], lo=1, hi=1, k=4) == [6, 5]
    assert lookup([1, 2, 3, 4]) == []  # nothing recurs
    assert lookup([1, 2, 1], lo=2, hi=3) == []  # below prompt_lookup_min
    assert lookup([1, 1, 1], k=0) == []


def test_ngram_proposer_keeps_histories_across_steps_and_rebuilds_on_change():
    p = NgramProposer(1, 3)
    h = [4, 5, 6, 4, 5]
    assert p.propose(["a"], [h], [2]) == [[6, 4]]
    h += [6]
    assert p.propose(["a"], [h], [2]) == [[4, 5]]
    # a different history under the same id (e.g. after preemption) is rebuilt
    assert p.propose(["a"], [[9, 8, 9]], [1]) == [[8]]
    p.drop("a")
    assert p.propose(["a", "b"], [[1, 2], [3, 3]], [1, 0]) == [[], []]
    assert p._idx.keys() == {"a"}  # nothing kept for a request asked for no tokens
    p.drop("a")
    assert not p._idx


def test_ngram_index_proposes_what_the_search_rule_proposes():
    """The proposer's incremental index against :func:`ngram_lookup` (the rule as a
    search) on random histories over small vocabularies, grown by 1-5 tokens a call
    as verification steps grow them, with ids beyond 16 bits; a new request now and
    then (the old one dropped)."""
    rng = np.random.default_rng(7)
    for trial in range(300):
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 11))  # above INDEX_MAX_N: the search path
        p = NgramProposer(lo, hi)
        assert p.indexed == (hi <= INDEX_MAX_N)
        vocab = int(rng.integers(1, 5))
        offset = int(rng.choice([0, 70_000, 4_000_000_000]))
        hist = [int(t) + offset for t in rng.integers(0, vocab, int(rng.integers(0, 12)))]
        req = 0
        for _ in range(25):
            k = int(rng.integers(0, 6))
            expect = lookup(hist, lo, hi, k)
            assert p.propose([f"r{req}"], [History(hist[:3], hist[3:])], [k]) == [expect], (
                trial, hist, lo, hi, k,
            )  # fmt: skip
            if rng.random() < 0.05:  # the request finished; another one
                p.drop(f"r{req}")
                req += 1
                hist = [int(t) + offset for t in rng.integers(0, vocab, 6)]
            else:
                grown = rng.integers(0, vocab, int(rng.integers(1, 6)))
                hist = hist + [int(t) + offset for t in grown]


def test_history_reads_prompt_then_outputs():
    h = History([1, 2, 3], [4, 5])
    assert len(h) == 5 and h[0] == 1 and h[3] == 4 and h[-1] == 5
    assert h[1:4] == [2, 3, 4] and h[3:] == [4, 5] and h[:2] == [1, 2]


def test_config_parses_vllm_spelling_and_refuses_bad_values():
    c = SpeculativeConfig.from_value(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}'
    )
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram",
        3,
        2,
        5,
    )
    d = SpeculativeConfig.from_value({"model": "x.gguf", "num_speculative_tokens": 2})
    assert d.method == "draft_model" and d.quantization == "auto"
    q = SpeculativeConfig.from_value(
        {"model": "x.gguf", "num_speculative_tokens": 2, "quantization": "none"}
    )
    assert q.quantization == "none"
    for bad, word in [
        ({"model": "x.gguf", "num_speculative_tokens": 2, "quantization": "q3"}, "quantization"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}, "quantization"),
        ("not json", "not JSON"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 5,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ]:
        with pytest.raises(ValueError, match=word):
            SpeculativeConfig.from_value(bad)  # type: ignore[arg-type]
    cfg = build_engine_config(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert cfg.speculative is not None and cfg.speculative.num_speculative_tokens == 2
    assert build_engine_config().speculative is None


def test_controller_shrinks_then_stops_a_request_whose_drafts_fail_and_probes_it():
    c = SpecController(4, step_cost_per_token=0.1)
    assert c.plan(["a"])[0] >= 3  # prior: worth trying at batch 1
    for _ in range(30):
        c.observe("a", 4, 0)
    assert c.alpha("a") < 0.05
    plans = [c.plan(["a"])[0] for _ in range(PROBE_EVERY)]
    assert plans[:-1] == [0] * (PROBE_EVERY - 1) and plans[-1] == 1  # one probe token
    for _ in range(30):
        c.observe("a", 4, 4)
    assert c.plan(["a"]) == [4]  # repetitive again: full proposals


def test_controller_keeps_only_near_sure_drafts_in_large_batches():
    c = SpecController(4, step_cost_per_token=0.1)
    ids = [f"r{i}" for i in range(32)]
    for r in ids[:16]:
        for _ in range(30):
            c.observe(r, 4, 1)  # alpha ~ 0.5: pays alone, not in a big batch
    for r in ids[16:]:
        for _ in range(30):
            c.observe(r, 4, 4)  # alpha ~ 1
    assert c.plan(ids[:1]) == [c.plan(ids[:1])[0]] and c.plan(ids[:1])[0] >= 1
    big = c.plan(ids)
    assert big[:16] == [0] * 16
    assert all(k >= 1 for k in big[16:])
    capped = SpecController(4, step_cost_per_token=0.1, disable_by_batch_size=8)
    assert capped.plan(ids[:8]) != [0] * 8 and capped.plan(ids[:9]) == [0] * 9
    fixed = SpecController(3, step_cost_per_token=0.1, adaptive=False)
    assert fixed.plan(ids) == [3] * 32


def test_controller_charges_a_draft_models_forwards():
    # a draft model's forward costs ~0.36 of a target step (4-bit draft, bf16 target):
    # sure drafts still pay in full at batch 1; at acceptance ~0.3 they do not (they
    # did under the lookup cost, which is what made draft-model speculation slower at
    # temperature > 0); a deeper draft of one request is charged the extra forward
    free = SpecController(3, step_cost_per_token=0.15)
    draft = SpecController(3, step_cost_per_token=0.15, draft_step_cost=0.36)
    for c in (free, draft):
        for _ in range(30):
            c.observe("sure", 3, 3)
            c.observe("weak", 3, 0) if _ % 3 else c.observe("weak", 3, 1)
    assert draft.plan(["sure"]) == [3] == free.plan(["sure"])
    assert free.plan(["weak"])[0] >= 1 and draft.plan(["weak"]) == [0]
    # one forward serves the batch: four sure requests draft together, while one sure
    # request among three weak ones does not pay for a forward on its own
    for r in ("s2", "s3", "s4", "w2", "w3"):
        for _ in range(30):
            draft.observe(r, 3, 3 if r.startswith("s") else 0)
    assert draft.plan(["sure", "s2", "s3", "s4"]) == [3, 3, 3, 3]
    assert draft.plan(["sure", "weak", "w2", "w3"]) == [0, 0, 0, 0]


def test_spec_decoder_leaves_out_empty_proposals():
    dec = SpecDecoder(
        SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 2})
    )
    out = dec.propose(["a", "b"], [[1, 2, 1], [1, 2, 3]])
    assert out == {"a": [2, 1]}


def test_spec_counters_from_metrics_text_and_the_run_delta():
    from kvserve.bench.spec_metrics import parse_spec_counters, spec_delta
    from kvserve.bench.workloads import WorkloadSpec, build_workload

    text = (
        "# TYPE kvserve:spec_decode_num_drafts counter\n"
        'kvserve:spec_decode_num_drafts_total{model_name="m"} 10\n'
        "# TYPE kvserve:spec_decode_num_draft_tokens counter\n"
        'kvserve:spec_decode_num_draft_tokens_total{model_name="m"} 40\n'
        "# TYPE kvserve:spec_decode_num_accepted_tokens counter\n"
        'kvserve:spec_decode_num_accepted_tokens_total{model_name="m"} 30\n'
        "# TYPE kvserve:spec_decode_num_accepted_tokens_per_pos counter\n"
        'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9\n'
        'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 8\n'
    )
    after = parse_spec_counters(text)
    assert after is not None and after["drafts"] == 10 and after["per_pos"] == {0: 9, 1: 8}
    d = spec_delta(None, after)
    assert d is not None and d["acceptance_rate"] == 0.75 and d["mean_acceptance_length"] == 4.0
    assert d["acceptance_rate_per_pos"] == [0.9, 0.8]
    assert parse_spec_counters("# nothing\n") is None
    for kind in ("spec-edit", "spec-code", "spec-json", "spec-quote"):
        w = build_workload(WorkloadSpec(kind=kind, num_requests=8, input_len=64, turns=2))
        assert w.num_requests == 8
        # the same seed gives the same workload
        assert w == build_workload(WorkloadSpec(kind=kind, num_requests=8, input_len=64, turns=2))
