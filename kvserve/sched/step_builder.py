"""One step's schedule as the policies build it (:class:`StepBuilder`), and the two
token-range rules both policies use (:func:`is_decode`, :func:`chunk_size`)."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.kv_cache.blocks import KVCacheBlocks
from kvserve.request import Request
from kvserve.sched.output import CachedRequestData, NewRequestData, Phase
from kvserve.sched.spec import scheduled_drafts


def is_decode(request: Request) -> bool:
    """True when the prompt is done and only the last sampled token is left to compute."""
    n = request.num_computed_tokens
    return n >= request.num_prompt_tokens and n == request.num_tokens - 1


def chunk_size(remaining: int, budget: int, cap: int = 0) -> int:
    """``min(remaining, budget)``, further capped by ``cap`` when ``cap > 0``."""
    n = min(remaining, budget)
    if cap > 0:
        n = min(n, cap)
    return n


class StepBuilder:
    """Collects one step's scheduled requests; a policy's ``schedule`` fills one and
    hands it to ``Scheduler._build_output``.

    Rules for callers: add each request at most once per step, after its blocks
    for ``num_tokens`` tokens were allocated and before ``num_computed_tokens``
    changes; ``add_new`` for a request just admitted (the runner gets its prompt and
    all its blocks), ``add_running`` for one the runner already holds (only the
    blocks added this step). ``new_to_runner`` (shared with the scheduler, emptied
    here) names running requests the runner has not seen yet (forked samples):
    ``add_running`` sends them as new, with all their blocks from ``block_ids_of``."""

    def __init__(
        self,
        new_to_runner: set[str] | None = None,
        block_ids_of: Callable[[str], list[int]] | None = None,
    ) -> None:
        self.new_to_runner = new_to_runner if new_to_runner is not None else set()
        self.block_ids_of = block_ids_of
        self.new_reqs: list[NewRequestData] = []
        self.cached_reqs = CachedRequestData()
        self.num_scheduled_tokens: dict[str, int] = {}
        self.scheduled_token_ids: dict[str, list[int]] = {}
        self.cached_seq_len: dict[str, int] = {}
        self.prefill_ids: list[str] = []
        self.decode_ids: list[str] = []
        self.spec_tokens: dict[str, list[int]] = {}

    def _add(self, request: Request, num_tokens: int) -> None:
        req_id = request.req_id
        start = request.num_computed_tokens
        self.num_scheduled_tokens[req_id] = num_tokens
        tokens = request.all_token_ids[start : start + num_tokens]
        drafts = scheduled_drafts(request, num_tokens)
        if drafts:
            tokens = tokens + drafts
            self.spec_tokens[req_id] = drafts
        self.scheduled_token_ids[req_id] = tokens
        self.cached_seq_len[req_id] = start
        (self.decode_ids if is_decode(request) else self.prefill_ids).append(req_id)

    def add_new(self, request: Request, num_tokens: int, block_ids: list[int]) -> None:
        self.new_to_runner.discard(request.req_id)
        self.new_reqs.append(
            NewRequestData(
                req_id=request.req_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
                sampling_params=request.sampling_params,
                adapter_id=request.adapter_id,
            )
        )
        self._add(request, num_tokens)

    def add_running(self, request: Request, num_tokens: int, new_blocks: KVCacheBlocks) -> None:
        if request.req_id in self.new_to_runner and self.block_ids_of is not None:
            self.add_new(request, num_tokens, self.block_ids_of(request.req_id))
            return
        self.cached_reqs.req_ids.append(request.req_id)
        self.cached_reqs.new_block_ids.append(new_blocks.get_block_ids())
        self.cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
        self._add(request, num_tokens)

    @property
    def phase(self) -> Phase:
        if self.prefill_ids and self.decode_ids:
            return "mixed"
        if self.prefill_ids:
            return "prefill"
        if self.decode_ids:
            return "decode"
        return "idle"
