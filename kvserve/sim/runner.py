"""Drive the real engine step loop with a stand-in executor instead of a model.

The engine's own :class:`~kvserve.engine.engine_core.EngineCore` (scheduler, KV
cache manager, request validation, leak check) on a :class:`StandInRunner`, one
``EngineCore.step()`` per iteration, the step number as the clock::

    step k: requests with arrival_step <= k are added (in workload order)
            scheduler.schedule()            -> the stand-in runner records the step
            stand-in executor               -> a fixed token for every request whose
                                               computed tokens reach its num_tokens
            scheduler.update_from_output()  -> first token / finish steps stamped

Requests never stop early (no EOS), so each produces exactly ``max_tokens`` tokens;
a workload that breaks the engine's length rule (``prompt_len + max_tokens >
max_model_len``) is refused up front with :class:`~kvserve.request.RequestError`.
A step that schedules nothing while requests are unfinished means nothing can ever
be scheduled again: :class:`SimulationError`, not a hang.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig, check_int
from kvserve.engine.engine_core import EngineCore
from kvserve.kv_cache.manager import cdiv
from kvserve.request import Request, RequestError, SamplingParams
from kvserve.sched.cost_model import CostModel, output_rows
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.sim.workload import VOCAB_SIZE, WorkloadRequest

DEFAULT_MAX_STEPS = 100_000


class SimulationError(RuntimeError):
    """The simulation cannot finish (no progress, or the step limit was reached)."""


def default_num_kv_blocks(config: SchedulerConfig, block_size: int) -> int:
    """Room for ``max_num_seqs`` requests of ``max_model_len`` tokens, plus the null block."""
    return config.max_num_seqs * cdiv(config.model_len, block_size) + 1


def fixed_token(req_id: str) -> int:
    """The token the stand-in executor always samples for ``req_id``."""
    return 1 + zlib.crc32(req_id.encode("utf-8")) % (VOCAB_SIZE - 1)


def _round(x: float) -> float:
    return round(x, 4)


def simulate(
    workload: Sequence[WorkloadRequest],
    config: SchedulerConfig,
    *,
    cache: CacheConfig | None = None,
    num_kv_blocks: int | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """Run ``workload`` to completion; return the JSON-ready result (see ``kvserve.sim.cli``).

    A simulator has no vocabulary: any token id >= 0 is accepted unless ``vocab_size``
    is given, in which case ids must lie in ``[0, vocab_size)``. ``cache`` gives the
    block size and prefix caching (default ``CacheConfig()``); ``num_kv_blocks``, when
    given, replaces its ``num_kv_blocks`` (None in both: room for ``max_num_seqs``
    requests of ``max_model_len``).

    Raises ValueError for a bad configuration or a request that can never be served,
    :class:`SimulationError` when the run cannot finish.
    """
    config = config.resolved()
    cache = CacheConfig() if cache is None else cache
    cache.validate()
    if num_kv_blocks is None:
        num_kv_blocks = cache.num_kv_blocks
    if num_kv_blocks is None:
        num_kv_blocks = default_num_kv_blocks(config, cache.block_size)
    check_int(
        "num_kv_blocks",
        num_kv_blocks,
        "num_kv_blocks=1024",
        minimum=2,
        why=" (block 0 is the null block)",
    )
    check_int("max_steps", max_steps, "max_steps=100000")
    if vocab_size is not None:
        check_int("vocab_size", vocab_size, "--vocab-size 49152")
    runner = StandInRunner(num_kv_blocks)
    engine = EngineCore(
        EngineConfig(
            cache=replace(cache, num_kv_blocks=num_kv_blocks),
            scheduler=config,
        ),
        loaded=SimulatedModel(
            config.model_len,
            vocab_size=UNBOUNDED_VOCAB if vocab_size is None else vocab_size,
        ),
        runner=runner,
        clock=runner.clock,
    )
    runner.engine = engine
    scheduler, kv = engine.scheduler, engine.kv_cache_manager

    # Every request is validated up front, so a bad workload fails before step 0.
    for w in workload:
        try:
            request = engine.make_request(
                list(w.prompt_token_ids),
                SamplingParams(max_tokens=w.max_tokens, temperature=0.0),
                request_id=w.req_id,
                arrival_time=float(w.arrival_step),
                cache_salt=w.cache_salt,
            )
            scheduler.check_request(request)
        except RequestError as e:
            raise RequestError(f"request {w.req_id!r}: {e}", param=e.param, code=e.code) from None
        runner.requests[w.req_id] = request

    pending = sorted(workload, key=lambda w: w.arrival_step)  # stable: file order kept
    next_arrival = 0
    steps: list[dict[str, Any]] = []
    step = 0
    while next_arrival < len(pending) or engine.has_unfinished_requests():
        if step >= max_steps:
            raise SimulationError(
                f"the workload did not finish within max_steps={max_steps} "
                f"({scheduler.get_num_unfinished_requests()} requests unfinished, "
                f"{len(pending) - next_arrival} not yet arrived): raise --max-steps"
            )
        runner.step = step
        while next_arrival < len(pending) and pending[next_arrival].arrival_step <= step:
            engine.add(runner.requests[pending[next_arrival].req_id])
            next_arrival += 1
        runner.record = None
        engine.step()  # the stand-in runner records the step it is given
        record = runner.record if runner.record is not None else _idle_record(step, engine)
        steps.append(record)
        if not record["num_scheduled_tokens"] and engine.has_unfinished_requests():
            stuck = ", ".join(sorted(r.req_id for r in scheduler.waiting)[:5])
            raise SimulationError(
                f"step {step}: nothing could be scheduled although "
                f"{scheduler.get_num_unfinished_requests()} requests are unfinished "
                f"(waiting: {stuck or 'none'}; {kv.num_free_blocks} of {kv.num_blocks - 1} KV "
                "blocks free): this configuration can never make progress; give the KV cache "
                "more blocks or lower max_num_seqs"
            )
        step += 1

    try:
        engine.check_no_leaks()
    except RuntimeError as e:
        raise SimulationError(str(e)) from None
    queries = kv.prefix_cache_queries
    return {
        "config": {
            "scheduler_policy": config.scheduler_policy,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_num_seqs": config.max_num_seqs,
            "max_model_len": config.max_model_len,
            "block_size": cache.block_size,
            "num_kv_blocks": num_kv_blocks,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "long_prefill_token_threshold": config.long_prefill_token_threshold,
            "prefill_budget_with_decodes": config.prefill_budget_with_decodes,
            "max_step_ms": config.max_step_ms,
            "num_batched_tokens_buckets": list(config.num_batched_tokens_buckets or ()),
            "num_seqs_buckets": list(config.num_seqs_buckets or ()),
            "kv_segment_size": cache.kv_segment_size,
            "max_steps": max_steps,
        },
        "steps": steps,
        "requests": {w.req_id: _request_summary(runner.requests[w.req_id]) for w in workload},
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


class StandInRunner:
    """The engine's model runner in the simulator (``kvserve.engine.runner.Runner``):
    :func:`stand_in_execute` on ``requests`` (every request of the workload, by id),
    recording each step it is given. Its :meth:`clock` is the current step number."""

    attention_backend = "simulated"

    def __init__(self, num_kv_blocks: int) -> None:
        self.num_kv_blocks = num_kv_blocks
        # The engine hands this to the scheduler when max_step_ms is set: fixed
        # coefficients (no online correction), so a simulation is deterministic.
        self.cost_model = CostModel.reference()
        self.requests: dict[str, Request] = {}
        self.step = 0
        self.record: dict[str, Any] | None = None
        self.engine: EngineCore | None = None

    def clock(self) -> float:
        return float(self.step)

    def step_cost_model(self, vocab_size: int, max_model_len: int) -> CostModel:
        """The fixed reference coefficients (``CostedRunner``), whatever the shapes."""
        return self.cost_model

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.engine is not None, "set StandInRunner.engine before stepping"
        self.record = _step_record(self.step, scheduler_output, self.engine)
        out = stand_in_execute(scheduler_output, self.requests)
        so = scheduler_output
        self.record["predicted_ms"] = _round(
            self.cost_model.predict_rows_ms(
                output_rows(
                    so.num_scheduled_tokens,
                    so.cached_seq_len,
                    out.sampled_token_ids,
                    so.num_scheduled_tokens_padded,
                    so.decode_batch_size_padded,
                )
            )
        )
        return out


def _step_record(step: int, output: SchedulerOutput, engine: EngineCore) -> dict[str, Any]:
    """One entry of the result's ``steps``: the schedule and the queues right after it."""
    return {
        "step": step,
        "phase": output.phase,
        "num_scheduled_tokens": dict(output.num_scheduled_tokens),
        "num_scheduled_tokens_padded": dict(output.num_scheduled_tokens_padded),
        "num_computed_tokens": dict(output.cached_seq_len),
        "decode_batch_padded": output.decode_batch_size_padded,
        "num_running": engine.scheduler.num_running,
        "num_waiting": engine.scheduler.num_waiting,
        "kv_usage": _round(engine.kv_cache_manager.usage),
        "predicted_ms": 0.0,  # set by StandInRunner.execute_model for a step that runs
    }


def _idle_record(step: int, engine: EngineCore) -> dict[str, Any]:
    """The entry of a step that scheduled nothing (the engine did not call the runner)."""
    return _step_record(step, SchedulerOutput.idle(), engine)


class _NoText:
    """The simulator's tokenizer: token ids have no text."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        return ""


UNBOUNDED_VOCAB = 1 << 62  # "no vocabulary": every non-negative id a workload names


@dataclass
class SimulatedModel:
    """The model facts the engine reads (``kvserve.engine.runner.ModelInfo``): no EOS,
    so every request produces exactly ``max_tokens`` tokens."""

    max_model_len: int
    name: str = "simulated"
    fingerprint: str = ""
    vocab_size: int = VOCAB_SIZE
    eos_token_ids: list[int] = field(default_factory=list)
    tokenizer: Any = field(default_factory=_NoText)
    dtype_name: str = "none"


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
