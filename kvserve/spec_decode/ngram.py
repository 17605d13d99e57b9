"""N-gram prompt lookup (vLLM's ``"method": "ngram"``): no second model.

For a request whose history ends with tokens ``... a b c``, find the most recent
earlier place where the same last ``n`` tokens occurred (``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``; the longest match wins) and
propose the tokens that followed it there::

    history: [ x a b c y z w ... q a b c ]      last n=3 tokens "a b c"
                     ^ match    ^ proposal: "y z w" (up to k tokens)

The search runs over the prompt and the outputs, so a summary that quotes its
prompt, an edit of given code, or JSON that repeats keys find long matches. It is
vectorized (numpy sliding windows), about tens of microseconds per request for
histories of a few thousand tokens.
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


class NgramProposer:
    """Prompt-lookup proposer; keeps each request's history as a growing numpy array
    (amortised append) so a step does not rebuild it."""

    step_cost = 0.0  # a lookup, no forward

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"invalid prompt_lookup_min={prompt_lookup_min}, prompt_lookup_max="
                f"{prompt_lookup_max}: need 1 <= min <= max (for example: 1 and 4)"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._hist: dict[str, tuple[np.ndarray, int]] = {}

    def _history(self, req_id: str, token_ids: Sequence[int]) -> np.ndarray:
        n = len(token_ids)
        buf, used = self._hist.get(req_id, (None, 0))
        if buf is None or used > n or (used and buf[used - 1] != token_ids[used - 1]):
            buf, used = np.empty(max(64, 2 * n), dtype=np.int64), 0
        if n > buf.shape[0]:
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:used] = buf[:used]
            buf = grown
        if n > used:
            buf[used:n] = token_ids[used:n]
        self._hist[req_id] = (buf, n)
        return buf[:n]

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
                continue
            out.append(ngram_lookup(self._history(req_id, tokens), self.min_n, self.max_n, k))
        return out

    def draft_probs(self, req_id: str, drafts: Sequence[int]) -> None:
        """Lookups are fixed tokens: verified by sample-and-match."""
        return None

    def drop(self, req_id: str) -> None:
        self._hist.pop(req_id, None)
