"""The scheduler's part of speculative decoding (vLLM V1's rules).

Draft tokens are scheduled tokens of their request::

    all_token_ids: [ ............ | t ]   spec_token_ids: [ d1 d2 d3 ]
                                  ^ num_computed_tokens (a decode: only t left)
    scheduled:                    [ t  d1 d2 d3 ]   1 + 3 tokens, one chunk

so they count against ``max_num_batched_tokens`` (a step's budget may cut the
drafts short) and need KV slots like any token. The runner verifies them in the
same forward: it samples after ``t`` and after every draft and keeps the drafts up
to the first one that differs from its sample (:mod:`kvserve.spec_decode.verify`),
returning ``accepted drafts + 1`` tokens. Then :func:`apply_verification` rolls the
request back::

    num_computed_tokens += 1 + 3, then -= rejected drafts
    blocks past cdiv(num_computed_tokens, block_size) are freed (they held only
    rejected tokens); full blocks are hashed into the prefix cache only after the
    accepted tokens are appended (the hash covers accepted tokens only).

Drafts never cause a preemption: :func:`fit_drafts` drops the drafts that do not
fit in the free blocks before the scheduler allocates.
"""

from __future__ import annotations

from kvserve.kv_cache.manager import KVCacheManager, cdiv
from kvserve.request import Request
from kvserve.sched.spec_stats import SpecDecodingStats


def fit_drafts(kv: KVCacheManager, request: Request, num_tokens: int) -> int:
    """``num_tokens`` to schedule for ``request``, with the draft tokens among them
    cut to what the free blocks hold without evicting anyone (at least the one
    token a decode needs is kept). Changes nothing."""
    base = request.num_tokens - request.num_computed_tokens
    if num_tokens <= base:
        return num_tokens
    bs = kv.block_size
    held = kv.num_held_blocks(request.req_id)
    need_base = max(0, cdiv(request.num_computed_tokens + base, bs) - held)
    room_blocks = kv.block_pool.num_free_blocks - need_base
    if room_blocks < 0:
        return base
    max_tokens = (held + need_base + room_blocks) * bs - request.num_computed_tokens
    return max(base, min(num_tokens, max_tokens))


def scheduled_drafts(request: Request, num_tokens: int) -> list[int]:
    """The draft tokens among the ``num_tokens`` scheduled for ``request`` now."""
    extra = request.num_computed_tokens + num_tokens - request.num_tokens
    return list(request.spec_token_ids[:extra]) if extra > 0 else []


def max_drafts(request: Request, max_model_len: int) -> int:
    """Most drafts the next step may verify: every accepted token must stay within
    ``max_tokens`` and every scheduled token within ``max_model_len`` (so a request
    never needs more KV than its admission check assumed)."""
    by_outputs = request.max_tokens - request.num_output_tokens - 1
    by_len = max_model_len - request.num_tokens
    return max(0, min(by_outputs, by_len))


def rollback(
    request: Request, num_drafts: int, sampled: list[int], stats: SpecDecodingStats
) -> None:
    """Before appending ``sampled``: undo the rejected drafts' computed tokens."""
    if len(sampled) > num_drafts + 1:
        raise RuntimeError(
            f"update_from_output: the model runner returned {len(sampled)} tokens for "
            f"{request.req_id!r}, which verified {num_drafts} drafts (at most "
            f"{num_drafts + 1} tokens)"
        )
    num_accepted = len(sampled) - 1
    request.num_computed_tokens -= num_drafts - num_accepted
    stats.observe(num_drafts, num_accepted)


def apply_verification(request: Request, kv: KVCacheManager, enable_prefix_caching: bool) -> None:
    """After appending the accepted tokens: clamp ``num_computed_tokens`` (a stop
    token may have cut the appended tokens short), free the blocks that held only
    rejected tokens, and cache the now full blocks."""
    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
    kv.trim(request, request.num_computed_tokens)
    if enable_prefix_caching:
        kv.cache_blocks(request, request.num_computed_tokens)


def take_proposals(request: Request, proposals: list[int] | None, max_model_len: int) -> None:
    """Store the runner's proposal for ``request``'s next step (clipped by
    :func:`max_drafts`); no proposal clears the old one."""
    if not proposals or request.is_finished:
        request.spec_token_ids = []
        return
    request.spec_token_ids = list(proposals[: max_drafts(request, max_model_len)])
