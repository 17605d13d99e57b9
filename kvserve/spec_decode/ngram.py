"""N-gram prompt lookup (vLLM's ``"method": "ngram"``): no second model.

For a request whose history ends with tokens ``... a b c``, find the most recent
earlier place where the same last ``n`` tokens occurred (``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``; the longest match wins) and
propose the tokens that followed it there::

    history: [ x a b c y z w ... q a b c ]      last n=3 tokens "a b c"
                     ^ match    ^ proposal: "y z w" (up to k tokens)

The search runs over the prompt and the outputs, so a summary that quotes its
prompt, an edit of given code, or JSON that repeats keys find long matches.

:func:`ngram_lookup` is the rule written as a search (numpy sliding windows; the
reference the tests hold the proposer to). :class:`NgramProposer` keeps an index
per request instead: for each length ``n`` a dict from every n-gram of the history
(that has a token after it) to the start of its latest occurrence, updated with the
few tokens a step appends, so a proposal is ``max_n`` dict lookups (the search
re-scans the whole history each call). The index costs ``max_n`` dict entries per history token (a few MB for an 8k-token
request), dropped with the request; a ``prompt_lookup_max`` above ``INDEX_MAX_N``
searches every call instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The proposal for one history (see the module docstring); [] when no n-gram of
    length ``min_n..max_n`` recurs or ``k == 0``."""
    length = int(tokens.shape[0])
    if k <= 0 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        # windows starting at 0 .. length-n-1 (the suffix itself excluded)
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size == 0:
            continue
        start = int(hits[-1]) + n  # the most recent occurrence
        proposal = tokens[start : start + k]
        if proposal.size:
            return [int(t) for t in proposal]
    return []


# An n-gram's tokens packed into one int key: the last token in the low bits.
_SHIFT = 32
# Above this prompt_lookup_max the index would keep that many dict entries per history
# token (and build them for the whole prompt at once): such configs search instead.
INDEX_MAX_N = 8


class _Index:
    """One request's history and, per length ``n``, the start of the latest occurrence
    of every n-gram that has a token after it (``starts[n][key]``)."""

    __slots__ = ("tokens", "starts", "done")

    def __init__(self, max_n: int) -> None:
        self.tokens: list[int] = []
        self.starts: list[dict[int, int]] = [{} for _ in range(max_n + 1)]
        self.done = 0  # every n-gram ending before this position is registered


class NgramProposer:
    """Prompt-lookup proposer: the rule of :func:`ngram_lookup`, answered from a
    per-request index (see the module docstring) that each call extends by the tokens
    the history gained. Rules for callers: a request's history only grows between
    calls (prompt + outputs; a history that does not extend the indexed one, e.g.
    another request under a reused id, is re-indexed from scratch); :meth:`drop`
    finished requests."""

    step_cost = 0.0  # a lookup, no forward

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"invalid prompt_lookup_min={prompt_lookup_min}, prompt_lookup_max="
                f"{prompt_lookup_max}: need 1 <= min <= max (for example: 1 and 4)"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.indexed = prompt_lookup_max <= INDEX_MAX_N  # else ngram_lookup per call
        self._idx: dict[str, _Index] = {}

    def _index(self, req_id: str, token_ids: Sequence[int]) -> _Index:
        n = len(token_ids)
        idx = self._idx.get(req_id)
        used = len(idx.tokens) if idx is not None else 0
        if idx is None or used > n or (used and idx.tokens[used - 1] != token_ids[used - 1]):
            idx, used = _Index(self.max_n), 0
            self._idx[req_id] = idx
        toks = idx.tokens
        if n > used:
            toks.extend(token_ids[used:n])
        # register the n-grams ending at done .. n-2 (each has a token after it); a
        # later occurrence overwrites an earlier one, so each key holds the latest
        lo, hi, starts = self.min_n, self.max_n, idx.starts
        for e in range(idx.done, n - 1):
            key = 0
            for m in range(1, hi + 1):
                s = e - m + 1
                if s < 0:
                    break
                key |= toks[s] << (_SHIFT * (m - 1))
                if m >= lo:
                    starts[m][key] = s
        idx.done = max(idx.done, n - 1)
        return idx

    def _lookup(self, idx: _Index, k: int) -> list[int]:
        toks = idx.tokens
        length = len(toks)
        top = min(self.max_n, length - 1)
        if k <= 0 or top < self.min_n:
            return []
        keys = []
        key = 0
        for m in range(1, top + 1):  # the suffix's keys, shortest first
            key |= toks[length - m] << (_SHIFT * (m - 1))
            keys.append(key)
        for m in range(top, self.min_n - 1, -1):  # the longest match wins
            s = idx.starts[m].get(keys[m - 1])
            if s is not None:
                return toks[s + m : s + m + k]
        return []

    def propose(
        self,
        req_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        num_tokens: Sequence[int],
        states: Sequence[object | None] | None = None,
    ) -> list[list[int]]:
        out: list[list[int]] = []
        for req_id, tokens, k in zip(req_ids, token_ids, num_tokens, strict=True):
            if k <= 0:
                out.append([])
            elif self.indexed:
                out.append(self._lookup(self._index(req_id, tokens), k))
            else:
                history = np.asarray(tokens[0 : len(tokens)], dtype=np.int64)
                out.append(ngram_lookup(history, self.min_n, self.max_n, k))
        return out

    def draft_probs(self, req_id: str, drafts: Sequence[int]) -> None:
        """Lookups are fixed tokens: verified by sample-and-match."""
        return None

    def drop(self, req_id: str) -> None:
        self._idx.pop(req_id, None)
