"""Constrained outputs that end within ``max_tokens``: the *closing plan*.

A grammar guarantees that whatever a constrained output writes is a valid prefix,
not that it ends: a small model inside a free-form JSON string (a URL, an email
body) can keep writing until ``max_tokens`` cuts the JSON. For a constraint with
``StructuredOutputsParams.within_max_tokens`` (forced tool calls set it) the runner
keeps this invariant at every step:

    len(closing_plan(state)) <= tokens the request may still generate

where ``closing_plan(state)`` is a token sequence, ending with EOS, that completes
the output from ``state`` to a string the grammar accepts (so a forced call's
arguments parse and validate against the function's schema). It is found by a
greedy walk of the grammar matcher (:func:`closing_plan`): at each step the allowed
token (the matcher's mask) that closes the most JSON structure (net change of open
strings, arrays and objects, read from the token's bytes and the lexical state:
outside a string, inside one, after a backslash), then the one with the fewest
content bytes; EOS first whenever it is allowed. Schema facts (required properties,
``minItems``, enums, number formats) need no modelling here: the mask only allows
what the schema allows, so the plan is always a valid completion, though not always
the shortest one (it is an upper bound, which is all the invariant needs).

How the runner keeps the invariant (:class:`BudgetState`, driven by
:class:`kvserve.structured.matcher.StructuredBatch`):

- once the remaining budget equals the plan's length, the mask allows only the
  plan's next token (the output closes on the plan, e.g. ``"}`` ends a runaway
  string argument and the object);
- before that, every sampled token is vetted: the plan from the state after it must
  still fit the budget left after it; a token that would not (it opens more
  structure than the budget can close) is replaced by the plan's next token;
- far from the end (more than ``2 * plan + SLACK_TOKENS`` tokens left) the vetting
  is skipped and the plan refreshed every ``REFRESH_TOKENS`` tokens, so an output
  that is nowhere near its budget pays nothing; closing costs grow by a few tokens
  per token at most, far less than that margin.

``min_plan_tokens`` (the plan from the start, cached per grammar by the compiler) is
the smallest ``max_tokens`` the engine accepts for such a constraint; a request
below it is refused with a 400 saying how large ``max_tokens`` must be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Lexical states of the JSON text written so far.
OUT, IN_STRING, ESCAPE = 0, 1, 2
# A token not allowed / never chosen by the walk.
_NEVER = np.iinfo(np.int32).max
# Far from the end: vet nothing while more than 2 * plan + SLACK_TOKENS remain...
SLACK_TOKENS = 32
# ... and refresh the plan at least every this many tokens.
REFRESH_TOKENS = 16
# Longest plan looked for (a longer one counts as none).
MAX_PLAN_TOKENS = 4096


class ClosingTables:
    """Per token and lexical state: the walk's preference score (lower first) and
    the lexical state after the token. Built once per tokenizer from the tokens'
    bytes (``token_bytes[i]`` for every id below the mask width; special tokens
    other than ``eos_token_id`` are never preferred)."""

    def __init__(
        self, token_bytes: list[bytes], eos_token_id: int | None, special: set[int]
    ) -> None:
        n = len(token_bytes)
        self.score = np.full((3, n), _NEVER, dtype=np.int64)
        self.next_state = np.zeros((3, n), dtype=np.int8)
        for i, raw in enumerate(token_bytes):
            if i in special or not raw:
                self.next_state[:, i] = (OUT, IN_STRING, IN_STRING)
                continue
            for state in (OUT, IN_STRING, ESCAPE):
                depth, content, end = _effect(raw, state)
                self.score[state, i] = depth * 4096 + min(content, 4095)
                self.next_state[state, i] = end
        if eos_token_id is not None and 0 <= eos_token_id < n:
            self.score[:, eos_token_id] = -(1 << 40)
            self.next_state[:, eos_token_id] = OUT
        self.width = n

    def advance(self, state: int, token_id: int) -> int:
        """The lexical state after ``token_id``."""
        if 0 <= token_id < self.width:
            return int(self.next_state[state, token_id])
        return state


_STRUCTURE = frozenset(b'{}[],:" \t\r\n')


def _effect(raw: bytes, state: int) -> tuple[int, int, int]:
    """(net depth change, content bytes, end state) of ``raw`` from ``state``; an
    open string counts as one level, like an open array or object."""
    if state == OUT and not any(b in b'{}[]"' for b in raw):
        return 0, sum(b not in _STRUCTURE for b in raw), OUT
    if state == IN_STRING and b'"' not in raw and b"\\" not in raw:
        return 0, len(raw), IN_STRING
    depth = content = 0
    for b in raw:
        if state == OUT:
            if b in b"{[":
                depth += 1
            elif b in b"}]":
                depth -= 1
            elif b == 0x22:  # "
                depth += 1
                state = IN_STRING
            elif b not in _STRUCTURE:
                content += 1
        elif state == IN_STRING:
            if b == 0x5C:  # backslash
                state = ESCAPE
                content += 1
            elif b == 0x22:
                depth -= 1
                state = OUT
            else:
                content += 1
        else:
            state = IN_STRING
            content += 1
    return depth, content, state


def allowed_tokens(matcher: Any, width: int) -> np.ndarray:
    """The matcher's mask as ``[width]`` bool (True = allowed)."""
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(words, bitorder="little")[:width].astype(bool)


def closing_plan(
    matcher: Any, state: int, tables: ClosingTables, eos_token_id: int | None
) -> list[int] | None:
    """A token sequence that takes ``matcher`` (left unchanged; a copy walks) from
    its state to the end of the output, EOS last; None when the walk finds none
    within ``MAX_PLAN_TOKENS`` (or the matcher fails)."""
    if matcher.is_error():
        return None
    walk = matcher.deep_copy()
    plan: list[int] = []
    while len(plan) < MAX_PLAN_TOKENS:
        allowed = allowed_tokens(walk, tables.width)
        scores = np.where(allowed, tables.score[state], _NEVER)
        token = int(scores.argmin())
        if not allowed[token] or scores[token] == _NEVER:
            return None
        plan.append(token)
        if token == eos_token_id:
            return plan
        if not walk.consume_token(token) or walk.is_error():
            return None
        state = tables.advance(state, token)
    return None


@dataclass
class BudgetState:
    """One request's side of the invariant (see the module docstring).

    ``limit``: its ``max_tokens``; ``used``: tokens it has generated; ``lex``: the
    lexical state of its text; ``plan``: the exact closing plan from its current
    state, or None when not computed since the last token; ``last_plan``: the length
    of the last exact plan; ``since``: tokens since then; ``pending``: (token, plan
    after it) computed by the last vetting, used when that token is accepted.
    """

    limit: int
    used: int = 0
    lex: int = OUT
    plan: list[int] | None = None
    last_plan: int = 0
    since: int = 0
    pending: tuple[int, list[int]] | None = None
    closed: bool = False  # the plan has been forced at least once
    hopeless: bool = False  # no plan found: the request goes on unguarded

    @property
    def left(self) -> int:
        """Tokens the request may still generate (this step's included)."""
        return self.limit - self.used

    def far_from_end(self) -> bool:
        """True while vetting can be skipped (plenty of budget, recent plan)."""
        return self.left - 1 > 2 * self.last_plan + SLACK_TOKENS and self.since < REFRESH_TOKENS
