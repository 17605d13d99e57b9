"""The step loop: schedule -> execute -> update, plus detokenization and stop strings.

    EngineCore.step():
      1. scheduler.schedule()              who runs, how many tokens (SchedulerOutput)
      2. runner.execute_model(output)      forward + sample (ModelRunnerOutput)
      3. scheduler.update_from_output()    append tokens, cache full blocks, stop checks
      4. detokenize new tokens; a stop string finishes the request in the scheduler

Rules a caller must keep:
- One thread drives an EngineCore (``step``, ``add_request``, ``abort_requests``);
  the async front (``async_engine.py``) serialises calls onto its loop thread.
- ``add_request`` either accepts the request or raises ValueError and changes
  nothing. ``abort_requests`` frees blocks at once. After every call, every KV block
  is active (held by a live request), reclaimable or empty: ``check_no_leaks()``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.args import with_max_model_len
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.outputs import RequestDelta, RequestMetrics
from kvserve.kv_cache import KVCacheManager
from kvserve.request import Request, RequestStatus, SamplingParams
from kvserve.sched import make_scheduler
from kvserve.sched.output import ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer


class EngineCore:
    """Owns the model runner, the KV cache manager and the scheduler of one engine."""

    def __init__(self, config: EngineConfig, *, loaded: Any | None = None) -> None:
        # Imported here so that torch is only loaded by engines, not by the CLI's help.
        from kvserve.model.loader import load_model
        from kvserve.worker.model_runner import ModelRunner

        if loaded is None:
            loaded = load_model(
                config.model.model, dtype=config.model.dtype, device=config.model.device
            )
        config = with_max_model_len(config, loaded.max_model_len)
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name: str = loaded.name
        self.max_model_len: int = config.scheduler.max_model_len
        self.eos_token_ids: list[int] = list(loaded.eos_token_ids)
        self.vocab_size: int = int(loaded.hf_config.vocab_size)
        self.runner = ModelRunner(loaded, config.cache, config.scheduler)
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_kv_blocks,
            config.cache.block_size,
            self.max_model_len,
            enable_caching=config.cache.enable_prefix_caching,
            hash_algo=config.cache.hash_algo,
            model_fingerprint=loaded.fingerprint,
        )
        self.scheduler = make_scheduler(config.scheduler, self.kv_cache_manager)
        fit = self.kv_cache_manager.max_concurrent_requests(self.max_model_len)
        if config.scheduler.scheduler_policy == "separated" and fit < config.scheduler.max_num_seqs:
            logger.warning(
                "separated policy: the KV cache holds only %d requests at max_model_len=%d, so at most "
                "%d will run at once (max_num_seqs=%d); lower max_model_len to what your requests need "
                "or give the KV cache more memory (kv_cache_memory_gib / num_kv_blocks)",
                fit,
                self.max_model_len,
                fit,
                config.scheduler.max_num_seqs,
            )
        self._states: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        self.num_failed_steps = 0

    # ------------------------------------------------------------------ requests
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (with the fix) if this request can never be served."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: send at least one token of text")
        bad = [
            t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]!r} is out of range: token ids must be integers in [0, {self.vocab_size})"
            )
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but max_model_len is {self.max_model_len}: shorten the prompt "
                f"to at most {self.max_model_len - 1} tokens or start the engine with a larger max_model_len"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens and max_tokens={params.max_tokens}, together "
                f"{n + params.max_tokens} > max_model_len={self.max_model_len}: lower max_tokens to at most "
                f"{self.max_model_len - n} or shorten the prompt"
            )

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError and changes nothing on bad input."""
        self.validate_request(prompt_token_ids, params)
        req_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if req_id in self._states:
            raise ValueError(f"request id {req_id!r} is already in use: pick a unique id")
        if params.max_tokens is None:
            params = _replace_max_tokens(params, self.max_model_len - len(prompt_token_ids))
        request = Request(
            req_id,
            prompt_token_ids,
            params,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            prompt=prompt,
        )
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        self.scheduler.add_request(request)
        self._states[req_id] = _RequestState(request, detok)
        return req_id

    def abort_requests(self, req_ids: list[str] | str) -> None:
        """Finish these requests as aborted and free their blocks now; unknown ids are ignored."""
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        live = [r for r in req_ids if r in self._states]
        if live:
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            for r in live:
                del self._states[r]

    def get_request(self, req_id: str) -> Request | None:
        state = self._states.get(req_id)
        return state.request if state else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestDelta]:
        """Run one scheduler step; return the news for every request that advanced."""
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and not sched_out.finished_req_ids:
            return []
        try:
            runner_out = self.runner.execute_model(sched_out)
        except Exception:
            # A failing batch must not take the engine down for later requests:
            # abort the requests of this step (their blocks are freed) and go on.
            logger.exception(
                "model execution failed; aborting the %d requests of this step",
                len(sched_out.num_scheduled_tokens),
            )
            self.num_failed_steps += 1
            failed = list(sched_out.num_scheduled_tokens)
            deltas = [self._abort_delta(r) for r in failed if r in self._states]
            self.abort_requests(failed)
            return deltas
        if sched_out.is_empty:
            runner_out = ModelRunnerOutput(sampled_token_ids={})
        core_outs = self.scheduler.update_from_output(sched_out, runner_out)
        deltas: list[RequestDelta] = []
        for out in core_outs:
            state = self._states.get(out.req_id)
            if state is None:
                continue
            request = state.request
            detok = state.detokenizer
            finish_reason = out.finish_reason
            # The scheduler finishes as "stop" only on EOS or a stop token id, which is
            # then the last new token: the detokenizer leaves its text out.
            stop_terminated = finish_reason == "stop"
            text = detok.update(out.new_token_ids, stop_terminated) if out.new_token_ids else ""
            stop_reason = out.stop_reason
            if finish_reason is None and detok.finished_by_stop:
                self.scheduler.finish_requests(out.req_id, RequestStatus.FINISHED_STOPPED)
                finish_reason, stop_reason = "stop", detok.stop_reason
            if finish_reason is not None:
                if not detok.finished_by_stop:
                    text += detok.flush()
                else:
                    stop_reason = detok.stop_reason
                del self._states[out.req_id]
            deltas.append(
                RequestDelta(
                    request_id=out.req_id,
                    new_token_ids=list(out.new_token_ids),
                    new_text=text,
                    new_logprobs=list(out.new_logprobs or []),
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    num_output_tokens=request.num_output_tokens,
                    metrics=_metrics(request),
                )
            )
        return deltas

    def _abort_delta(self, req_id: str) -> RequestDelta:
        request = self._states[req_id].request
        return RequestDelta(
            request_id=req_id,
            new_token_ids=[],
            new_text="",
            finish_reason="abort",
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=request.num_output_tokens,
        )

    # ------------------------------------------------------------------ health
    def stats(self) -> dict[str, Any]:
        """Numbers for /metrics and logs (plain data)."""
        kv = self.kv_cache_manager
        sched = self.scheduler
        return {
            "num_requests_running": sched.num_running,
            "num_requests_waiting": sched.num_waiting,
            "kv_cache_usage_perc": kv.usage,
            "num_active_blocks": kv.num_active_blocks,
            "num_reclaimable_blocks": kv.num_reclaimable_blocks,
            "num_empty_blocks": kv.num_empty_blocks,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "total_padding_tokens": sched.total_padding_tokens,
            "scheduler_state": str(sched.state),
            "num_failed_steps": self.num_failed_steps,
        }

    def check_no_leaks(self) -> None:
        """Raise RuntimeError if the KV cache's invariants are broken, or if blocks are
        still active while no request is unfinished."""
        self.kv_cache_manager.check_invariants()
        if not self.has_unfinished_requests() and self.kv_cache_manager.num_active_blocks:
            raise RuntimeError(
                f"KV leak: {self.kv_cache_manager.num_active_blocks} blocks active with no request running"
            )


def _metrics(request: Request) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finished_time=request.finished_time,
    )


def _replace_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=max_tokens)
