"""Benchmark workloads: deterministic lists of sessions built from a seed.

A workload is a tuple of :class:`Session`. A session is one conversation: a fixed
``system_text`` (a shared system prompt or document, possibly shared with other
sessions) followed by one or more user turns. Single-turn workloads have sessions of
one turn. The load generator sends a session's turns in order, each after the
previous answer came back, resending the whole history every time:

    turn 0 prompt:  [ system | user0 ]
    turn 1 prompt:  [ system | user0 | answer0 | user1 ]
    turn 2 prompt:  [ system | user0 | answer0 | user1 | answer1 | user2 ]

Kinds (``WorkloadSpec.kind``):

- ``random``: each request a random prompt of ``input_len`` tokens (±``range_ratio``)
  and ``output_len`` output tokens (±``range_ratio``).
- ``shared-prefix``: ``num_prefixes`` system prompts of ``prefix_len`` tokens; request
  ``i`` uses prefix ``i % num_prefixes`` plus a unique ``input_len``-token question.
- ``multi-turn``: ``num_requests // turns`` conversations of ``turns`` turns, each
  user turn ``input_len`` tokens, each answer ``output_len`` tokens.
- ``long-doc``: ``num_docs`` documents of ``doc_len`` tokens; request ``i`` asks an
  ``input_len``-token question about document ``i % num_docs``.
- ``multi-tenant``: ``num_prefixes`` tenant system prompts of ``prefix_len`` tokens,
  each request picks one with Zipf popularity (tenant ``k`` has weight
  ``1 / (k+1) ** zipf_s``) and adds a unique ``input_len``-token question; arrivals
  come from the load generator (Poisson at ``--request-rate``). The scale-out
  routing experiment: which replica holds which tenant's prefix.
- ``interference``: ``num_decodes`` short-prompt, long-output streams that start at
  t=0 (tag ``decode``), then ``num_long_prompts`` prompts of ``long_prompt_len``
  tokens (tag ``prefill``) arriving at ``long_prompt_start_s + k * long_prompt_gap_s``.
  This is the chunked-prefill experiment: the decodes' ITL shows the prefill stalls.
- ``chat-interference`` (shaped like the peer harness's ``interference.jsonl``): of
  ``num_requests`` requests one in seven is a document of 2,500-3,000 tokens asking for
  24/32/48 output tokens (tag ``doc``), the rest short chats of 70-300 tokens asking
  for 80/96/112/128 (tag ``chat``), in shuffled order; arrivals come from the load
  generator (Poisson at ``--request-rate``, 3 in the peer runs). Long prompts arrive
  while chats stream: the step-time budget's case.
- ``chat-multiturn`` (shaped like ``multiturn.jsonl``): ``num_requests // turns``
  conversations of ``turns`` turns sent as independent requests, conversation by
  conversation; turn ``t``'s prompt is the conversation so far (user turns of 40-120
  tokens, fixed 40-token assistant turns), so each turn after the first is a
  prefix-cache hit on the one before; 48 output tokens each. The peer runs send them
  all at once with 24 in flight.

Token counts. Text is built from "words", each a single token with its leading space
(" the", " cat"). With a tokenizer (:class:`WordVocabulary.from_tokenizer`), the words
are vocabulary entries that decode to ``" <letters>"`` and re-encode to exactly that one
id, so under byte-level BPE (Llama 3, SmolLM, Qwen2, GPT-2) a text of ``n`` words is
exactly ``n`` tokens, also when pieces are concatenated (every boundary is a space).
Without a tokenizer (:meth:`WordVocabulary.default`) a list of common short English
words is used: nearly all are one token in BPE vocabularies, so counts are
approximate (typically within a few percent, plus any special tokens the server adds,
such as BOS or a chat template). ``Workload.exact_lengths`` says which case applies.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from kvserve.bench.sessions import Session as Session  # re-exported
from kvserve.bench.sessions import Turn as Turn  # re-exported
from kvserve.bench.vocabulary import WordVocabulary as WordVocabulary  # re-exported
from kvserve.config import check_int

WorkloadKind = Literal[
    "random",
    "shared-prefix",
    "multi-turn",
    "long-doc",
    "interference",
    "multi-tenant",
    "chat-interference",
    "chat-multiturn",
    "spec-edit",
    "spec-code",
    "spec-json",
    "spec-quote",
]
# the spec-* kinds are speculative decoding's (kvserve.bench.spec_workloads): answers
# copy from the prompt
WORKLOAD_KINDS: tuple[str, ...] = get_args(WorkloadKind)


@dataclass(frozen=True)
class WorkloadSpec:
    """All workload sizes; which ones matter depends on ``kind`` (module docstring)."""

    kind: str = "random"
    num_requests: int = 64
    seed: int = 0
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int = 1024
    num_prefixes: int = 4
    turns: int = 4
    num_docs: int = 2
    doc_len: int = 2048
    num_decodes: int = 8
    num_long_prompts: int = 4
    long_prompt_len: int = 2048
    long_prompt_start_s: float = 0.5
    long_prompt_gap_s: float = 1.5
    zipf_s: float = 1.1

    def validate(self) -> None:
        """Raise ValueError naming the bad value, the rule and a valid example."""
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(
                f"invalid workload {self.kind!r}: must be one of {', '.join(WORKLOAD_KINDS)} "
                "(for example: --workload shared-prefix)"
            )
        positive = {
            "num_requests": ("--num-requests 64", self.num_requests),
            "input_len": ("--input-len 256", self.input_len),
            "output_len": ("--output-len 64", self.output_len),
        }
        if self.kind in ("shared-prefix", "multi-tenant"):
            positive["prefix_len"] = ("--prefix-len 1024", self.prefix_len)
            positive["num_prefixes"] = ("--num-prefixes 4", self.num_prefixes)
        if self.kind in ("multi-turn", "chat-multiturn", "spec-quote"):
            positive["turns"] = ("--turns 4", self.turns)
        if self.kind == "long-doc":
            positive["num_docs"] = ("--num-docs 2", self.num_docs)
            positive["doc_len"] = ("--doc-len 2048", self.doc_len)
        if self.kind == "interference":
            positive["num_decodes"] = ("--num-decodes 8", self.num_decodes)
            positive["long_prompt_len"] = ("--long-prompt-len 2048", self.long_prompt_len)
        for name, (example, value) in positive.items():
            check_int(name, value, example)
        if self.kind == "multi-tenant" and not self.zipf_s >= 0:
            raise ValueError(f"invalid zipf_s={self.zipf_s!r}: must be >= 0 (for example: 1.1)")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(
                f"invalid range_ratio={self.range_ratio!r}: must be in [0, 1) (for example: --range-ratio 0.25)"
            )
        if self.kind in ("multi-turn", "chat-multiturn") and self.num_requests < self.turns:
            raise ValueError(
                f"invalid num_requests={self.num_requests!r}: multi-turn needs at least --turns "
                f"({self.turns}) requests, one conversation (for example: --num-requests {self.turns * 8})"
            )
        if self.kind == "interference" and (
            self.num_long_prompts < 0 or self.long_prompt_start_s < 0 or self.long_prompt_gap_s < 0
        ):
            raise ValueError(
                "invalid interference timing: num_long_prompts, long_prompt_start_s and "
                "long_prompt_gap_s must be >= 0 (for example: --num-long-prompts 4)"
            )


@dataclass(frozen=True)
class Workload:
    """A built workload: the spec it came from and its sessions in arrival order."""

    spec: WorkloadSpec
    sessions: tuple[Session, ...]
    exact_lengths: bool

    @property
    def num_requests(self) -> int:
        return sum(s.num_requests for s in self.sessions)

    def describe(self) -> dict[str, Any]:
        """JSON-ready description for results.json."""
        return {
            "spec": asdict(self.spec),
            "num_sessions": len(self.sessions),
            "num_requests": self.num_requests,
            "exact_lengths": self.exact_lengths,
            "total_prompt_tokens_first_turns": sum(
                s.system_len + s.turns[0].prompt_len for s in self.sessions
            ),
        }


def _vary(rng: random.Random, center: int, ratio: float) -> int:
    """A length uniform in [center*(1-ratio), center*(1+ratio)], at least 1."""
    if ratio == 0.0:
        return center
    low = max(1, math.floor(center * (1 - ratio)))
    high = max(low, math.ceil(center * (1 + ratio)))
    return rng.randint(low, high)


def build_workload(spec: WorkloadSpec, vocab: WordVocabulary | None = None) -> Workload:
    """Build the sessions of ``spec``; the same spec and vocabulary give the same workload.

    Raises ValueError from :meth:`WorkloadSpec.validate` for bad sizes.
    """
    spec.validate()
    vocab = vocab or WordVocabulary.default()
    rng = random.Random(spec.seed)
    sessions: list[Session] = []
    if spec.kind == "random":
        for i in range(spec.num_requests):
            n_in = _vary(rng, spec.input_len, spec.range_ratio)
            n_out = _vary(rng, spec.output_len, spec.range_ratio)
            sessions.append(Session(i, "", 0, (Turn(vocab.text(rng, n_in), n_in, n_out),)))
    elif spec.kind == "shared-prefix":
        prefixes = [vocab.text(rng, spec.prefix_len) for _ in range(spec.num_prefixes)]
        for i in range(spec.num_requests):
            group = i % spec.num_prefixes
            turn = Turn(vocab.text(rng, spec.input_len), spec.input_len, spec.output_len)
            sessions.append(
                Session(i, prefixes[group], spec.prefix_len, (turn,), prefix_group=group)
            )
    elif spec.kind == "multi-tenant":
        prefixes = [vocab.text(rng, spec.prefix_len) for _ in range(spec.num_prefixes)]
        weights = [1.0 / (k + 1) ** spec.zipf_s for k in range(spec.num_prefixes)]
        for i in range(spec.num_requests):
            group = rng.choices(range(spec.num_prefixes), weights)[0]
            turn = Turn(vocab.text(rng, spec.input_len), spec.input_len, spec.output_len)
            sessions.append(
                Session(i, prefixes[group], spec.prefix_len, (turn,), prefix_group=group)
            )
    elif spec.kind == "multi-turn":
        for i in range(spec.num_requests // spec.turns):
            turns = tuple(
                Turn(vocab.text(rng, spec.input_len), spec.input_len, spec.output_len)
                for _ in range(spec.turns)
            )
            sessions.append(Session(i, "", 0, turns, prefix_group=i))
    elif spec.kind == "long-doc":
        docs = [vocab.text(rng, spec.doc_len) for _ in range(spec.num_docs)]
        for i in range(spec.num_requests):
            doc = i % spec.num_docs
            turn = Turn(vocab.text(rng, spec.input_len), spec.input_len, spec.output_len)
            sessions.append(Session(i, docs[doc], spec.doc_len, (turn,), prefix_group=doc))
    elif spec.kind == "chat-interference":
        sessions = _chat_interference(spec, vocab, rng)
    elif spec.kind == "chat-multiturn":
        sessions = _chat_multiturn(spec, vocab, rng)
    elif spec.kind.startswith("spec-"):
        from kvserve.bench.spec_workloads import build_spec_sessions

        sessions = build_spec_sessions(
            spec.kind, spec.num_requests, spec.input_len, spec.output_len, spec.turns, rng
        )
        return Workload(spec, tuple(sessions), exact_lengths=False)
    else:  # interference
        for i in range(spec.num_decodes):
            turn = Turn(vocab.text(rng, spec.input_len), spec.input_len, spec.output_len)
            sessions.append(Session(i, "", 0, (turn,), arrival_s=0.0, tag="decode"))
        for k in range(spec.num_long_prompts):
            turn = Turn(vocab.text(rng, spec.long_prompt_len), spec.long_prompt_len, 1)
            arrival = spec.long_prompt_start_s + k * spec.long_prompt_gap_s
            sessions.append(
                Session(spec.num_decodes + k, "", 0, (turn,), arrival_s=arrival, tag="prefill")
            )
    return Workload(spec, tuple(sessions), exact_lengths=vocab.exact)


CHAT_PROMPT_TOKENS = (70, 300)
CHAT_OUTPUT_TOKENS = (80, 96, 112, 128)
DOC_PROMPT_TOKENS = (2500, 3000)
DOC_OUTPUT_TOKENS = (24, 32, 48)
DOCS_EVERY = 7  # one request in seven is a document
MULTITURN_USER_TOKENS = (40, 120)
MULTITURN_ASSISTANT_TOKENS = 40
MULTITURN_OUTPUT_TOKENS = 48


def _chat_interference(
    spec: WorkloadSpec, vocab: WordVocabulary, rng: random.Random
) -> list[Session]:
    """Short chats and long documents in shuffled order (see the module docstring)."""
    num_docs = max(1, round(spec.num_requests / DOCS_EVERY)) if spec.num_requests > 1 else 0
    kinds = ["doc"] * num_docs + ["chat"] * (spec.num_requests - num_docs)
    rng.shuffle(kinds)
    sessions: list[Session] = []
    for i, kind in enumerate(kinds):
        if kind == "doc":
            n_in, n_out = rng.randint(*DOC_PROMPT_TOKENS), rng.choice(DOC_OUTPUT_TOKENS)
        else:
            n_in, n_out = rng.randint(*CHAT_PROMPT_TOKENS), rng.choice(CHAT_OUTPUT_TOKENS)
        sessions.append(Session(i, "", 0, (Turn(vocab.text(rng, n_in), n_in, n_out),), tag=kind))
    return sessions


def _chat_multiturn(spec: WorkloadSpec, vocab: WordVocabulary, rng: random.Random) -> list[Session]:
    """One independent request per turn; turn t's prompt is the conversation so far."""
    sessions: list[Session] = []
    for c in range(spec.num_requests // spec.turns):
        history, history_len = "", 0
        for _ in range(spec.turns):
            n_user = rng.randint(*MULTITURN_USER_TOKENS)
            history += vocab.text(rng, n_user)
            history_len += n_user
            turn = Turn(history, history_len, MULTITURN_OUTPUT_TOKENS)
            sessions.append(Session(len(sessions), "", 0, (turn,), prefix_group=c))
            history += vocab.text(rng, MULTITURN_ASSISTANT_TOKENS)
            history_len += MULTITURN_ASSISTANT_TOKENS
    return sessions


def render_prompt(session: Session, turn_index: int, answers: list[str]) -> str:
    """The /v1/completions prompt of turn ``turn_index``: system, then every earlier
    user turn followed by its answer, then this turn's user text (plain concatenation,
    so each prompt starts with the whole previous prompt and answer).

    ``answers`` must hold at least ``turn_index`` answers (the earlier turns').
    """
    if len(answers) < turn_index:
        raise ValueError(
            f"turn {turn_index} needs {turn_index} earlier answers, got {len(answers)}"
        )
    parts = [session.system_text]
    for k in range(turn_index):
        parts.append(session.turns[k].user_text)
        parts.append(answers[k])
    parts.append(session.turns[turn_index].user_text)
    return "".join(parts)


def render_messages(session: Session, turn_index: int, answers: list[str]) -> list[dict[str, str]]:
    """The /v1/chat/completions messages of turn ``turn_index`` (same history rule)."""
    if len(answers) < turn_index:
        raise ValueError(
            f"turn {turn_index} needs {turn_index} earlier answers, got {len(answers)}"
        )
    messages: list[dict[str, str]] = []
    if session.system_text:
        messages.append({"role": "system", "content": session.system_text.lstrip()})
    for k in range(turn_index):
        messages.append({"role": "user", "content": session.turns[k].user_text.lstrip()})
        messages.append({"role": "assistant", "content": answers[k]})
    messages.append({"role": "user", "content": session.turns[turn_index].user_text.lstrip()})
    return messages


def arrival_times(
    num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Start offsets (seconds) of ``num`` arrivals.

    ``request_rate`` is arrivals per second; ``math.inf`` sends everything at t=0.
    Gaps are gamma distributed with shape ``burstiness`` and mean ``1/request_rate``
    (``burstiness == 1`` is a Poisson process; smaller is burstier). The first arrival
    is at t=0. Deterministic for a seed.
    """
    if not request_rate > 0:
        raise ValueError(
            f"invalid request_rate={request_rate!r}: must be > 0 or inf (for example: --request-rate 4)"
        )
    if not burstiness > 0:
        raise ValueError(
            f"invalid burstiness={burstiness!r}: must be > 0 (for example: --burstiness 1.0)"
        )
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed ^ 0x5EED)
    times: list[float] = []
    t = 0.0
    for i in range(num):
        if i > 0:
            t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
        times.append(t)
    return times
