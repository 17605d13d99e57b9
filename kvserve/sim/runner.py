"""Drive the real scheduler and KV cache manager with a stand-in executor.

The same :func:`kvserve.sched.make_scheduler` and
:class:`kvserve.kv_cache.KVCacheManager` the engine uses, one step per iteration::

    step k: requests with arrival_step <= k are added (in workload order)
            scheduler.schedule()            -> record the step
            stand-in executor               -> a fixed token for every request whose
                                               computed tokens reach its num_tokens
            scheduler.update_from_output()  -> record first token / finish steps

Requests never stop early (no EOS), so each produces exactly ``max_tokens`` tokens;
a workload where ``prompt_len + max_tokens > max_model_len`` is refused up front.
A step that schedules nothing while requests are unfinished means nothing can ever
be scheduled again: :class:`SimulationError`, not a hang.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from kvserve.config import SchedulerConfig
from kvserve.kv_cache.manager import KVCacheManager, cdiv
from kvserve.request import Request, SamplingParams
from kvserve.sched import make_scheduler
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.sim.workload import VOCAB_SIZE, WorkloadRequest

DEFAULT_MAX_STEPS = 100_000


class SimulationError(RuntimeError):
    """The simulation cannot finish (no progress, or the step limit was reached)."""


def default_num_kv_blocks(config: SchedulerConfig) -> int:
    """Room for ``max_num_seqs`` requests of ``max_model_len`` tokens, plus the null block."""
    return config.max_num_seqs * cdiv(config.max_model_len, config.block_size) + 1


def fixed_token(req_id: str) -> int:
    """The token the stand-in executor always samples for ``req_id``."""
    return 1 + zlib.crc32(req_id.encode("utf-8")) % (VOCAB_SIZE - 1)


def _round(x: float) -> float:
    return round(x, 4)


def simulate(
    workload: Sequence[WorkloadRequest],
    config: SchedulerConfig,
    *,
    num_kv_blocks: int | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> dict[str, Any]:
    """Run ``workload`` to completion; return the JSON-ready result (see ``kvserve.sim.cli``).

    Raises ValueError for a bad configuration or a request that can never be served,
    :class:`SimulationError` when the run cannot finish.
    """
    config = config.resolved()
    if num_kv_blocks is None:
        num_kv_blocks = default_num_kv_blocks(config)
    if not isinstance(num_kv_blocks, int) or isinstance(num_kv_blocks, bool) or num_kv_blocks < 2:
        raise ValueError(
            f"invalid num_kv_blocks={num_kv_blocks!r}: must be an integer >= 2 (block 0 is the "
            "null block) (for example: num_kv_blocks=1024)"
        )
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(
            f"invalid max_steps={max_steps!r}: must be a positive integer (for example: max_steps=100000)"
        )
    kv = KVCacheManager(
        num_kv_blocks,
        config.block_size,
        config.max_model_len,
        enable_caching=config.enable_prefix_caching,
    )
    clock = _StepClock()
    scheduler = make_scheduler(config, kv, clock=clock)

    requests: dict[str, Request] = {}
    for w in workload:
        if w.prompt_len + w.max_tokens > config.max_model_len:
            raise ValueError(
                f"request {w.req_id!r}: prompt_len + max_tokens = {w.prompt_len} + {w.max_tokens} = "
                f"{w.prompt_len + w.max_tokens} exceeds max_model_len={config.max_model_len}, so it "
                f"could not produce max_tokens tokens: raise --max-model-len to at least "
                f"{w.prompt_len + w.max_tokens} or lower max_tokens"
            )
        request = Request(
            w.req_id,
            list(w.prompt_token_ids),
            SamplingParams(max_tokens=w.max_tokens, temperature=0.0),
            arrival_time=float(w.arrival_step),
            cache_salt=w.cache_salt,
        )
        scheduler.check_request(request)
        requests[w.req_id] = request

    pending = sorted(workload, key=lambda w: w.arrival_step)  # stable: file order kept
    next_arrival = 0
    steps: list[dict[str, Any]] = []
    step = 0
    while next_arrival < len(pending) or scheduler.has_unfinished_requests():
        if step >= max_steps:
            raise SimulationError(
                f"the workload did not finish within max_steps={max_steps} "
                f"({scheduler.get_num_unfinished_requests()} requests unfinished, "
                f"{len(pending) - next_arrival} not yet arrived): raise --max-steps"
            )
        clock.step = step
        while next_arrival < len(pending) and pending[next_arrival].arrival_step <= step:
            scheduler.add_request(requests[pending[next_arrival].req_id])
            next_arrival += 1
        output = scheduler.schedule()
        steps.append(
            {
                "step": step,
                "phase": output.phase,
                "num_scheduled_tokens": dict(output.num_scheduled_tokens),
                "num_scheduled_tokens_padded": dict(output.num_scheduled_tokens_padded),
                "num_computed_tokens": dict(output.cached_seq_len),
                "decode_batch_padded": output.decode_batch_size_padded,
                "num_running": scheduler.num_running,
                "num_waiting": scheduler.num_waiting,
                "kv_usage": _round(kv.usage),
            }
        )
        if output.is_empty and scheduler.has_unfinished_requests():
            stuck = ", ".join(sorted(r.req_id for r in scheduler.waiting)[:5])
            raise SimulationError(
                f"step {step}: nothing could be scheduled although "
                f"{scheduler.get_num_unfinished_requests()} requests are unfinished "
                f"(waiting: {stuck or 'none'}; {kv.num_free_blocks} of {kv.num_blocks - 1} KV "
                "blocks free): this configuration can never make progress; give the KV cache "
                "more blocks or lower max_num_seqs"
            )
        scheduler.update_from_output(output, stand_in_execute(output, requests))
        step += 1

    kv.check_invariants()
    if kv.num_active_blocks:
        raise SimulationError(f"KV leak: {kv.num_active_blocks} blocks still active at the end")
    queries = kv.prefix_cache_queries
    return {
        "config": {
            "scheduler_policy": config.scheduler_policy,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_num_seqs": config.max_num_seqs,
            "max_model_len": config.max_model_len,
            "block_size": config.block_size,
            "num_kv_blocks": num_kv_blocks,
            "enable_prefix_caching": config.enable_prefix_caching,
            "long_prefill_token_threshold": config.long_prefill_token_threshold,
            "num_batched_tokens_buckets": list(config.num_batched_tokens_buckets or ()),
            "num_seqs_buckets": list(config.num_seqs_buckets or ()),
            "kv_segment_size": config.kv_segment_size,
            "max_steps": max_steps,
        },
        "steps": steps,
        "requests": {w.req_id: _request_summary(requests[w.req_id]) for w in workload},
        "summary": {
            "num_steps": step,
            "total_padding_tokens": scheduler.total_padding_tokens,
            "prefix_cache_hit_rate": _round(kv.prefix_cache_hits / queries) if queries else 0.0,
            "num_preemptions": scheduler.num_preemptions,
        },
    }


def stand_in_execute(output: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
    """A fixed token for every scheduled request whose computed tokens reach its
    ``num_tokens`` after this step (mid-prefill chunks sample nothing)."""
    sampled: dict[str, list[int]] = {}
    for req_id, n in output.num_scheduled_tokens.items():
        if output.cached_seq_len[req_id] + n == requests[req_id].num_tokens:
            sampled[req_id] = [fixed_token(req_id)]
    return ModelRunnerOutput(sampled_token_ids=sampled)


def _request_summary(request: Request) -> dict[str, Any]:
    def step_of(t: float | None) -> int | None:
        return None if t is None else int(t)

    return {
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_cached_tokens": max(0, request.num_cached_tokens),
        "num_output_tokens": request.num_output_tokens,
        "first_scheduled_step": step_of(request.first_scheduled_time),
        "first_token_step": step_of(request.first_token_time),
        "finish_step": step_of(request.finished_time),
        "num_preemptions": request.num_preemptions,
    }


class _StepClock:
    """The scheduler's clock in the simulator: the current step number."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self) -> float:
        return float(self.step)
