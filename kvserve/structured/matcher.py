"""``StructuredBatch``: the model runner's grammar matchers (one per constrained
request) and the token masks it hands to the sampler each step.

    step:  prepare inputs ─▶ start_masks(sampled req ids) ──┐ (mask thread)
           forward pass  ───────────────────────────────────┤ overlapped
           logits ─▶ sampler(token_mask = masks.result()) ◀─┘
           accept(req id, sampled token) for each constrained request

A mask is ``[rows, vocab]`` bool, True where the token is allowed: the constrained
rows from their matcher (llguidance fills a packed 32-bit bitmask, unpacked here),
every other row all True. A matcher that allows nothing, or is in an error state
after a token (the compile-time probe, ``GrammarCompiler.check``, makes this rare),
is a *failure*: its row allows only EOS so that sampling stays defined, and
:meth:`take_failures` reports it so that the engine ends the request with an error,
never as a normal stop.

Rules for callers: :meth:`StructuredBatch.add` a request when the runner learns it
(with the tokens it already generated, e.g. after a preemption or a fork),
:meth:`accept` every token it samples for it, :meth:`drop` it when it finishes.
Only one :meth:`start_masks` may be outstanding at a time.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvserve.request import SamplingParams
from kvserve.structured.compiler import GrammarCompiler


class StructuredBatch:
    """Matchers by request id, and the per-step masks (see the module docstring)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.matchers: dict[str, Any] = {}
        self._failures: dict[str, str] = {}
        self._pool: ThreadPoolExecutor | None = None

    def add(self, req_id: str, params: SamplingParams, output_token_ids: list[int]) -> None:
        """Track ``req_id`` if its params carry structured outputs, replaying the
        tokens it already generated."""
        if params.structured_outputs is None:
            return
        matcher = self.compiler.matcher(params.structured_outputs)
        if output_token_ids:
            matcher.consume_tokens(list(output_token_ids))
        self.matchers[req_id] = matcher

    def drop(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self._failures.pop(req_id, None)

    def accept(self, req_id: str, token_id: int) -> None:
        matcher = self.matchers.get(req_id)
        if matcher is None:
            return
        ok = matcher.consume_token(token_id)
        if matcher.is_error() or ok is False:
            self._fail(req_id, matcher, f"token {token_id} was not accepted")

    def take_failures(self) -> dict[str, str]:
        """Requests whose matcher failed since the last call: req id -> why (once each;
        a failed request keeps its EOS-only row until :meth:`drop`)."""
        failures, self._failures = self._failures, {}
        return failures

    def _fail(self, req_id: str, matcher: Any, what: str) -> None:
        detail = matcher.get_error() if matcher.is_error() else ""
        detail = detail.strip().splitlines()[0] if detail.strip() else what
        self._failures.setdefault(
            req_id,
            f"structured outputs failed mid-generation: {detail}; the output would not "
            "match the requested format (simplify the schema, regex or grammar)",
        )

    def start_masks(self, req_ids: list[str]) -> Future[torch.Tensor] | None:
        """Start filling the masks of these sampled rows on the mask thread; None when
        none of them is constrained (the sampler then gets no mask)."""
        matchers = [self.matchers.get(r) for r in req_ids]
        if all(m is None for m in matchers):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-mask")
        return self._pool.submit(self._masks, list(req_ids), matchers)

    def masks_now(self, req_ids: list[str]) -> torch.Tensor | None:
        """:meth:`start_masks` without the thread (tests, benchmarks)."""
        matchers = [self.matchers.get(r) for r in req_ids]
        return None if all(m is None for m in matchers) else self._masks(req_ids, matchers)

    def _masks(self, req_ids: list[str], matchers: list[Any]) -> torch.Tensor:
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        rows = [i for i, m in enumerate(matchers) if m is not None]
        bitmask = allocate_token_bitmask(len(rows), self.vocab_size)  # [R, ceil(V/32)] int32
        for j, i in enumerate(rows):
            fill_next_token_bitmask(matchers[i], bitmask, j)
        allowed = unpack_bitmask(bitmask, self.vocab_size)  # [R, V]
        eos = self.compiler.eos_token_id
        empty = ~allowed.any(dim=1)
        for j, i in enumerate(rows):
            if empty[j] or matchers[i].is_error():  # llguidance then allows only EOS
                self._fail(req_ids[i], matchers[i], "no token is allowed")
        if eos is not None:
            allowed[empty, eos] = True
        mask = torch.ones(len(matchers), self.vocab_size, dtype=torch.bool)
        mask[rows] = allowed
        return mask

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 words (bit ``b`` of word ``w`` = token ``32 w + b``) ->
    ``[R, vocab_size]`` bool."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
