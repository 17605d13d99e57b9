"""Where the engine puts a batch's KV blocks: block tables from the real allocator.

:func:`engine_block_tables` admits ``num_requests`` prompts at once into the real
:class:`~kvserve.sched.mixed.MixedScheduler` over the real
:class:`~kvserve.kv_cache.KVCacheManager` (chunked prefill under the token budget,
decodes growing one token per step beside the later prompts, as ``kvserve serve``
runs them) with a stand-in model that samples a fixed token, and returns every
request's block table once each holds ``context + 1`` tokens. With ``churn`` an
earlier generation of other prompts runs to completion first, so the measured one
allocates from a pool that has been used and freed (prefix caching on: the freed
full blocks are cached, evicted in LRU order). :func:`adjacent_fraction` measures
how contiguous a table is. Used by ``kvserve bench forward`` (decode-attention rows
with the engine's placement) and by the allocator's contiguity tests.
"""

from __future__ import annotations

from collections.abc import Sequence


def adjacent_fraction(block_ids: Sequence[int]) -> float:
    """Fraction of neighbouring pairs in ``block_ids`` whose ids are consecutive
    (``b[i + 1] == b[i] + 1``); 1.0 for a table of fewer than two blocks."""
    if len(block_ids) < 2:
        return 1.0
    return sum(1 for x, y in zip(block_ids, block_ids[1:], strict=False) if y == x + 1) / (
        len(block_ids) - 1
    )


def engine_block_tables(
    num_requests: int,
    context: int,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    decode_tokens: int = 64,
    max_num_batched_tokens: int = 2048,
    enable_caching: bool = True,
    churn: bool = False,
    max_steps: int = 100_000,
) -> list[list[int]]:
    """The block tables (``cdiv(context + 1, block_size)`` ids each) of ``num_requests``
    requests with prompts of ``context - decode_tokens`` tokens (at least 1), admitted
    together and run until every one holds ``context + 1`` tokens of KV.

    ``num_blocks`` (the pool, null block included) defaults to 1.25 × what the batch
    needs. Raises RuntimeError when the run does not get there within ``max_steps``
    scheduler steps (a pool too small for the batch, for example)."""
    from kvserve.config import SchedulerConfig
    from kvserve.kv_cache import KVCacheManager, cdiv
    from kvserve.request import Request, SamplingParams
    from kvserve.sched import make_scheduler
    from kvserve.sched.output import ModelRunnerOutput

    target = context + 1
    prompt_len = max(1, context - decode_tokens)
    # no request may finish before the last one gets there: the first ones decode while
    # the later prompts prefill, at most one token per step of that
    prefill_steps = cdiv(num_requests * prompt_len, max(1, max_num_batched_tokens - num_requests))
    max_tokens = target - prompt_len + prefill_steps + num_requests + 16
    per_req = cdiv(prompt_len + max_tokens, block_size)
    if num_blocks is None:
        num_blocks = 1 + (num_requests * per_req * 5) // 4
    max_model_len = per_req * block_size
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching=enable_caching)
    cfg = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=max(num_requests, 1),
        max_num_batched_tokens=max_num_batched_tokens,
    )
    sched = make_scheduler(cfg, kv)
    token = [1]

    def prompt() -> list[int]:
        out = list(range(token[0], token[0] + prompt_len))
        token[0] += prompt_len
        return out

    def run(reqs: list[Request], done: object) -> None:
        for r in reqs:
            sched.add_request(r)
        for _ in range(max_steps):
            if done():  # type: ignore[operator]
                return
            out = sched.schedule()
            sampled = {}
            for req_id, n in out.num_scheduled_tokens.items():
                if out.cached_seq_len[req_id] + n == sched.requests[req_id].num_tokens:
                    sampled[req_id] = [7]
            sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        raise RuntimeError(
            f"engine_block_tables: {num_requests} x {context} tokens did not fit a pool of "
            f"{num_blocks} blocks within {max_steps} steps"
        )

    if churn:  # an earlier generation of other prompts, run to the end and freed
        first = [
            Request(f"w{i}", prompt(), SamplingParams(max_tokens=decode_tokens))
            for i in range(num_requests)
        ]
        run(first, lambda: not sched.has_unfinished_requests())
    reqs = [
        Request(f"r{i}", prompt(), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for i in range(num_requests)
    ]
    run(reqs, lambda: all(r.num_computed_tokens >= target for r in reqs))
    kv.check_invariants()
    return [kv.get_block_ids(r.req_id)[: cdiv(target, block_size)] for r in reqs]
