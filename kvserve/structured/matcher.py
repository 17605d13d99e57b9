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

A constraint with ``within_max_tokens`` (forced tool calls) also keeps a
:class:`~kvserve.structured.budget.BudgetState`: its row allows only the closing
plan's next token once the budget left equals the plan's length, and
:meth:`vet` replaces a sampled token after which the plan would no longer fit
(``kvserve.structured.budget`` has the rules).

Rules for callers: :meth:`StructuredBatch.add` a request when the runner learns it
(with the tokens it already generated, e.g. after a preemption or a fork),
:meth:`vet` each token sampled for it (and its forks' first tokens) and use the
replacement it returns, :meth:`accept` every token it keeps, :meth:`drop` it when
it finishes. Only one :meth:`start_masks` may be outstanding at a time.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from kvserve.structured.bitmask import unpack_bitmask
from kvserve.structured.budget import BudgetState, closing_plan
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.params import StructuredOutputsParams


class Constrained(Protocol):
    """What :meth:`StructuredBatch.add` reads of a request's sampling parameters
    (``kvserve.request.SamplingParams`` has both; this package stays below it)."""

    @property
    def structured_outputs(self) -> StructuredOutputsParams | None: ...

    @property
    def max_tokens(self) -> int | None: ...


class StructuredBatch:
    """Matchers by request id, and the per-step masks (see the module docstring)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.matchers: dict[str, Any] = {}
        self.budgets: dict[str, BudgetState] = {}
        self._failures: dict[str, str] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.num_closed = 0  # requests whose closing plan was forced (stats, tests)

    def add(self, req_id: str, params: Constrained, output_token_ids: list[int]) -> None:
        """Track ``req_id`` if its params carry structured outputs, replaying the
        tokens it already generated."""
        so = params.structured_outputs
        if so is None:
            return
        matcher = self.compiler.matcher(so)
        if output_token_ids:
            matcher.consume_tokens(list(output_token_ids))
        self.matchers[req_id] = matcher
        if so.within_max_tokens and params.max_tokens is not None:
            tables = self.compiler.closing_tables()
            budget = BudgetState(limit=params.max_tokens, used=len(output_token_ids))
            for token_id in output_token_ids:
                budget.lex = tables.advance(budget.lex, token_id)
            self.budgets[req_id] = budget

    def drop(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.budgets.pop(req_id, None)
        self._failures.pop(req_id, None)

    def accept(self, req_id: str, token_id: int) -> None:
        matcher = self.matchers.get(req_id)
        if matcher is None:
            return
        ok = matcher.consume_token(token_id)
        if matcher.is_error() or ok is False:
            self._fail(req_id, matcher, f"token {token_id} was not accepted")
        budget = self.budgets.get(req_id)
        if budget is not None:
            budget.used += 1
            budget.lex = self.compiler.closing_tables().advance(budget.lex, token_id)
            pending, budget.pending = budget.pending, None
            if pending is not None and pending[0] == token_id:
                self._set_plan(budget, pending[1])
            else:
                budget.plan = None
                budget.since += 1

    # ------------------------------------------------------------------ budgets
    def _set_plan(self, budget: BudgetState, plan: list[int] | None) -> None:
        if plan is None:
            budget.hopeless = True  # no known way to end: go on unguarded
            budget.plan = None
            return
        budget.plan, budget.last_plan, budget.since = plan, len(plan), 0

    def _plan(self, req_id: str, budget: BudgetState) -> list[int] | None:
        """The exact closing plan from ``req_id``'s current state (computed once
        per state)."""
        if budget.plan is None and not budget.hopeless:
            plan = closing_plan(
                self.matchers[req_id],
                budget.lex,
                self.compiler.closing_tables(),
                self.compiler.eos_token_id,
            )
            self._set_plan(budget, plan)
        return budget.plan

    def _forced(self, req_id: str) -> int | None:
        """The only token ``req_id`` may take now (its plan's next one, when the
        budget left is down to the plan), else None."""
        budget = self.budgets.get(req_id)
        if budget is None or budget.hopeless or budget.far_from_end():
            return None
        plan = self._plan(req_id, budget)
        if plan and len(plan) >= budget.left:
            if not budget.closed:
                budget.closed = True
                self.num_closed += 1
            return plan[0]
        return None

    def vet(self, req_id: str, token_id: int, *, own: bool = True) -> int | None:
        """The token to use instead of ``token_id``, sampled for ``req_id`` this
        step (``own=False``: for a fork of it, whose first token comes from the same
        state), or None to keep it. A token is replaced, by the closing plan's next
        one, when the plan from the state after it would not fit the budget left
        after it. Changes no parse state (:meth:`accept` does)."""
        budget = self.budgets.get(req_id)
        matcher = self.matchers.get(req_id)
        if budget is None or matcher is None or budget.hopeless:
            return None
        if token_id == self.compiler.eos_token_id:
            return None
        plan = budget.plan
        if plan and token_id == plan[0]:
            if own:
                budget.pending = (token_id, plan[1:])
            return None
        if budget.far_from_end():
            return None
        plan = self._plan(req_id, budget)
        if not plan:
            return None
        after = matcher.deep_copy()
        if not after.consume_token(token_id) or after.is_error():
            return None  # not allowed at all: accept() reports the failure
        tables = self.compiler.closing_tables()
        then = closing_plan(
            after, tables.advance(budget.lex, token_id), tables, self.compiler.eos_token_id
        )
        if then is not None and len(then) <= budget.left - 1:
            if own:
                budget.pending = (token_id, then)
            return None
        if own:
            budget.pending = (plan[0], plan[1:])
            if not budget.closed:
                budget.closed = True
                self.num_closed += 1
        return plan[0]

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

    def _masks(self, req_ids: list[str], matchers: list[Any]) -> torch.Tensor:
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        rows = [i for i, m in enumerate(matchers) if m is not None]
        bitmask = allocate_token_bitmask(len(rows), self.vocab_size)  # [R, ceil(V/32)] int32
        for j, i in enumerate(rows):
            fill_next_token_bitmask(matchers[i], bitmask, j)
        allowed = unpack_bitmask(bitmask, self.vocab_size)  # [R, V]
        for j, i in enumerate(rows):
            forced = self._forced(req_ids[i]) if req_ids[i] in self.budgets else None
            if forced is not None:  # the budget left is down to the closing plan
                allowed[j] = False
                allowed[j, forced] = True
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
