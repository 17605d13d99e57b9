"""Workload determinism and shape: prefix sharing, multi-turn history, arrivals."""

from __future__ import annotations

import math
import statistics

import pytest

from kvserve.bench.workloads import (
    WordVocabulary,
    WorkloadSpec,
    arrival_times,
    build_workload,
    render_messages,
    render_prompt,
)


def words(text: str) -> int:
    return len(text.split())


def test_same_seed_same_workload_other_seed_differs() -> None:
    spec = WorkloadSpec(
        kind="random", num_requests=8, input_len=20, output_len=5, range_ratio=0.5, seed=3
    )
    assert build_workload(spec) == build_workload(spec)
    other = build_workload(WorkloadSpec(**{**spec.__dict__, "seed": 4}))
    assert other.sessions != build_workload(spec).sessions


def test_random_lengths_within_range() -> None:
    spec = WorkloadSpec(
        kind="random", num_requests=50, input_len=40, output_len=10, range_ratio=0.25
    )
    w = build_workload(spec)
    assert w.num_requests == 50
    for s in w.sessions:
        (turn,) = s.turns
        assert 30 <= turn.prompt_len <= 50 and words(turn.user_text) == turn.prompt_len
        assert 7 <= turn.output_len <= 13
    assert len({s.turns[0].prompt_len for s in w.sessions}) > 1


def test_shared_prefix_groups_share_exact_system_prompts() -> None:
    spec = WorkloadSpec(
        kind="shared-prefix", num_requests=12, num_prefixes=3, prefix_len=30, input_len=6
    )
    w = build_workload(spec)
    systems = [s.system_text for s in w.sessions]
    assert len(set(systems)) == 3
    for i, s in enumerate(w.sessions):
        assert s.prefix_group == i % 3
        assert s.system_text == systems[i % 3]
        assert words(s.system_text) == 30 and s.system_len == 30
        assert words(s.turns[0].user_text) == 6
    # every question is unique, so requests share exactly the system prompt
    assert len({s.turns[0].user_text for s in w.sessions}) == 12
    assert render_prompt(w.sessions[0], 0, []) == systems[0] + w.sessions[0].turns[0].user_text


def test_multi_turn_history_grows_with_each_answer() -> None:
    spec = WorkloadSpec(kind="multi-turn", num_requests=9, turns=3, input_len=5, output_len=4)
    w = build_workload(spec)
    assert len(w.sessions) == 3 and all(len(s.turns) == 3 for s in w.sessions)
    s = w.sessions[0]
    answers = [" a b c d", " e f g h"]
    p0 = render_prompt(s, 0, [])
    p1 = render_prompt(s, 1, answers[:1])
    p2 = render_prompt(s, 2, answers)
    assert p1.startswith(p0 + answers[0]) and p2.startswith(p1 + answers[1])
    assert words(p2) == 3 * 5 + 2 * 4
    msgs = render_messages(s, 2, answers)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[1]["content"] == answers[0] and msgs[4]["content"] == s.turns[2].user_text.lstrip()
    with pytest.raises(ValueError, match="earlier answers"):
        render_prompt(s, 2, answers[:1])


def test_long_doc_questions_cycle_over_documents() -> None:
    spec = WorkloadSpec(kind="long-doc", num_requests=6, num_docs=2, doc_len=50, input_len=4)
    w = build_workload(spec)
    docs = [s.system_text for s in w.sessions]
    assert docs[0] != docs[1] and docs[0] == docs[2] == docs[4] and docs[1] == docs[3] == docs[5]
    assert all(words(d) == 50 for d in docs)


def test_interference_has_timed_decodes_and_long_prompts() -> None:
    spec = WorkloadSpec(
        kind="interference",
        num_decodes=3,
        input_len=4,
        output_len=50,
        num_long_prompts=2,
        long_prompt_len=40,
        long_prompt_start_s=1.0,
        long_prompt_gap_s=2.0,
    )
    w = build_workload(spec)
    assert [s.tag for s in w.sessions] == ["decode"] * 3 + ["prefill"] * 2
    assert [s.arrival_s for s in w.sessions] == [0.0, 0.0, 0.0, 1.0, 3.0]
    assert all(s.turns[0].output_len == 50 for s in w.sessions[:3])
    assert all(s.turns[0].prompt_len == 40 and s.turns[0].output_len == 1 for s in w.sessions[3:])


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (WorkloadSpec(kind="chat"), "--workload"),
        (WorkloadSpec(input_len=0), "--input-len"),
        (WorkloadSpec(kind="shared-prefix", num_prefixes=0), "--num-prefixes"),
        (WorkloadSpec(kind="multi-turn", num_requests=2, turns=4), "--num-requests"),
        (WorkloadSpec(range_ratio=1.5), "--range-ratio"),
    ],
)
def test_bad_specs_raise_with_example(spec: WorkloadSpec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_workload(spec)


def test_arrival_times_poisson_and_inf() -> None:
    assert arrival_times(4, math.inf) == [0.0] * 4
    times = arrival_times(2000, 10.0, seed=1)
    assert times == arrival_times(2000, 10.0, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:], strict=False))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
    # Poisson gaps: standard deviation equals the mean; burstiness 4 is smoother
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.15)
    smooth = arrival_times(2000, 10.0, burstiness=4.0, seed=1)
    smooth_gaps = [b - a for a, b in zip(smooth, smooth[1:], strict=False)]
    assert statistics.stdev(smooth_gaps) < 0.7 * statistics.stdev(gaps)
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_times(3, 0.0)


class WordLevelTokenizer:
    """A fake tokenizer: ids map to fixed strings; encode splits before spaces."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.ids = {p: i for i, p in enumerate(pieces)}

    def __len__(self) -> int:
        return len(self.pieces)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out: list[int] = []
        for w in text.split(" ")[1:]:
            piece = " " + w
            out.extend([self.ids[piece]] if piece in self.ids else [self.ids[c] for c in piece])
        return out


def _letters(i: int) -> str:
    a, b = divmod(i, 26)
    return "q" + chr(97 + a % 26) + chr(97 + b)


def test_vocabulary_from_tokenizer_keeps_exact_single_token_words() -> None:
    chars = [" "] + [chr(c) for c in range(97, 123)]
    good = [" " + _letters(i) for i in range(150)]
    pieces = ["<s>", "ab", " x1", *chars, *good]
    vocab = WordVocabulary.from_tokenizer(WordLevelTokenizer(pieces))
    assert vocab.exact and set(vocab.words) == set(good)
    tok = WordLevelTokenizer(pieces)
    spec = WorkloadSpec(
        kind="shared-prefix", num_requests=4, num_prefixes=2, prefix_len=33, input_len=7
    )
    for s in build_workload(spec, vocab).sessions:
        assert len(tok.encode(render_prompt(s, 0, []))) == 40
    with pytest.raises(ValueError, match="single-token words"):
        WordVocabulary.from_tokenizer(WordLevelTokenizer([*chars, *good[:50]]))


def test_default_vocabulary_is_approximate_single_words() -> None:
    vocab = WordVocabulary.default()
    assert not vocab.exact and len(vocab.words) > 200
    assert all(w.startswith(" ") and w[1:].isalpha() for w in vocab.words)


def test_chat_interference_shape() -> None:
    """Like the peer interference.jsonl: one in seven a 2.5-3k-token document, the rest
    short chats, shuffled, tagged, arrivals left to the load generator."""
    w = build_workload(WorkloadSpec(kind="chat-interference", num_requests=42, seed=1))
    assert w == build_workload(WorkloadSpec(kind="chat-interference", num_requests=42, seed=1))
    docs = [s for s in w.sessions if s.tag == "doc"]
    chats = [s for s in w.sessions if s.tag == "chat"]
    assert len(docs) == 6 and len(chats) == 36
    for s in docs:
        (t,) = s.turns
        assert 2500 <= t.prompt_len <= 3000 and words(t.user_text) == t.prompt_len
        assert t.output_len in (24, 32, 48)
    for s in chats:
        (t,) = s.turns
        assert 70 <= t.prompt_len <= 300 and t.output_len in (80, 96, 112, 128)
    assert all(s.arrival_s is None for s in w.sessions)
    order = [s.tag for s in w.sessions]
    assert order != sorted(order) and order != sorted(order, reverse=True)  # shuffled


def test_chat_multiturn_turns_extend_the_previous_prompt() -> None:
    """Like the peer multiturn.jsonl: every turn is its own request whose prompt is the
    previous turn's prompt, a fixed assistant turn and a new user turn."""
    w = build_workload(WorkloadSpec(kind="chat-multiturn", num_requests=60, turns=5))
    assert w.num_requests == 60 and len({s.prefix_group for s in w.sessions}) == 12
    prompts = [render_prompt(s, 0, []) for s in w.sessions]
    for i, s in enumerate(w.sessions):
        (t,) = s.turns
        assert t.output_len == 48 and words(prompts[i]) == t.prompt_len
        if i % 5:
            prev = w.sessions[i - 1]
            assert prev.prefix_group == s.prefix_group
            assert prompts[i].startswith(prompts[i - 1])
            assert 40 + 40 <= t.prompt_len - prev.turns[0].prompt_len <= 40 + 120
        else:
            assert 40 <= t.prompt_len <= 120
    with pytest.raises(ValueError, match="num_requests"):
        build_workload(WorkloadSpec(kind="chat-multiturn", num_requests=3, turns=5))
