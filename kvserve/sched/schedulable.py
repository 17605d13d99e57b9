"""Scheduler entry check: what a request must satisfy to ever be scheduled.

Also how many sequences are running (:func:`running_seqs`).

The request's *content* (token ids, ``max_tokens``, ``logit_bias``, grammar) is
validated once, before it reaches the scheduler, by
:func:`kvserve.engine.validation.validate_request`; what lives here are the facts only
the scheduler knows: its queues (a request id already queued), ``max_num_seqs`` (a
group of samples runs together) and the KV cache's size (a request that could never
fit would wait forever). The engine front's admission (queue limits, bursts) is
:mod:`kvserve.engine.request_limits`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvserve.kv_cache.manager import KVCacheManager, cdiv
from kvserve.prompt_check import check_prompt
from kvserve.request import Request, RequestError, RequestStatus


def running_seqs(running: Iterable[Request]) -> int:
    """Sequences the running requests hold or will hold: each request plus the samples
    it will fork once its prompt is computed (``pending_forks``)."""
    return sum(1 + len(r.pending_forks) for r in running)


def check_schedulable(
    request: Request,
    queued: Mapping[str, Request],
    *,
    max_num_seqs: int,
    max_model_len: int,
    kv: KVCacheManager,
) -> None:
    """Raise ValueError when the id is taken (``queued``: the scheduler's unfinished
    requests) or the request was already used, and :class:`RequestError` when its
    group of samples exceeds ``max_num_seqs``, its prompt leaves no room under
    ``max_model_len`` (:func:`~kvserve.prompt_check.check_prompt`), or it could never fit in
    the whole KV cache (it would wait forever). Changes nothing."""
    req_id = request.req_id
    if req_id in queued:
        raise RequestError(
            f"request id {req_id!r} is already queued: use a unique id per request",
            param="request_id",
        )
    if (
        request.status != RequestStatus.WAITING
        or request.num_computed_tokens
        or request.output_token_ids
    ):
        raise ValueError(f"request {req_id!r} is not fresh ({request!r}): add a new Request object")
    group = 1 + len(request.pending_forks)
    if group > max_num_seqs:
        raise RequestError(
            f"request {req_id!r} asks for {group} samples but max_num_seqs is "
            f"{max_num_seqs}: lower n/best_of to at most {max_num_seqs} or start "
            f"the engine with max_num_seqs >= {group}",
            param="n",
        )
    if any(s.req_id in queued for s in request.pending_forks):
        raise RequestError(
            f"a sample id of request {req_id!r} is already queued: use a unique id",
            param="request_id",
        )
    # max_tokens was validated before; generating up to max_model_len finishes the
    # request as "length", so here only the prompt must leave room.
    check_prompt(request.prompt_token_ids, None, max_model_len=max_model_len)
    # Tokens that ever need KV: everything except the last sampled token.
    worst = min(request.num_prompt_tokens + request.max_tokens - 1, max_model_len)
    if kv.max_concurrent_requests(worst) < 1:
        bs = kv.block_size
        raise RequestError(
            f"request {req_id!r} may need KV for {worst} tokens ({cdiv(worst, bs)} blocks of "
            f"{bs}) but the KV cache has only {kv.num_blocks - 1} usable blocks: lower "
            f"max_tokens or the prompt length, or give the cache more blocks "
            f"(for example: num_kv_blocks={cdiv(worst, bs) + 1})",
            param="max_tokens",
        )
