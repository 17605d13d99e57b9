"""The step loop: schedule -> execute -> update, plus detokenization and stop strings.

    EngineCore.step():
      1. scheduler.schedule()              who runs, how many tokens (SchedulerOutput)
      2. runner.execute_model(output)      forward + sample (ModelRunnerOutput)
      3. scheduler.update_from_output()    append tokens, cache full blocks, stop checks
      4. detokenize new tokens; a stop string finishes the request in the scheduler

Rules a caller must keep:
- One thread drives an EngineCore (``step``, ``add_request``, ``abort_requests``);
  the async front (``async_engine.py``) serialises calls onto its loop thread.
- A request is validated once, by :meth:`EngineCore.make_request` (or
  ``add_request``, which calls it): it is accepted or :class:`RequestError` (a
  ValueError naming the field) is raised and nothing changes. ``abort_requests`` frees blocks at once. After every call, every KV block
  is active (held by a live request), reclaimable or empty: ``check_no_leaks()``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvserve.config import EngineConfig
from kvserve.engine.allocator import tune_allocator
from kvserve.engine.args import with_max_model_len
from kvserve.engine.assembly import (
    cost_model_stats,
    kv_fingerprint,
    kv_offload_tier,
    model_runner,
    offload_stats,
    step_cost_model,
)
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.output_processor import RequestState, make_delta, process_output
from kvserve.engine.outputs import EngineStats, RequestDelta
from kvserve.engine.runner import ConnectedRunner, ModelInfo, Runner
from kvserve.engine.validation import RequestLimits, validate_request
from kvserve.kv_cache import KVCacheManager
from kvserve.kv_transfer.connector import KVConnector
from kvserve.lora.errors import LoRAError
from kvserve.request import (
    FinishReason,
    Request,
    RequestError,
    RequestStatus,
    SamplingParams,
)
from kvserve.sched import make_scheduler
from kvserve.sched.cost_model import CostModel, output_rows, prompt_features, step_features
from kvserve.sched.output import Logprobs, ModelRunnerOutput, SchedulerOutput
from kvserve.structured.compiler import GrammarCompiler

if TYPE_CHECKING:  # the runner owns the manager; torch stays out of the simulator's imports
    from kvserve.lora.manager import LoRAManager

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the model runner, the KV cache manager and the scheduler of one engine.

    ``loaded``: the model (default: load ``config.model.model``). ``runner``: the
    model runner (default: a :class:`~kvserve.worker.model_runner.ModelRunner` on
    ``loaded``); an injected runner must come with ``loaded``, the facts about the
    model it runs (see :mod:`kvserve.engine.runner`). ``clock``: the time stamped on
    requests (the simulator passes its step number). ``kv_connector``: both sides of
    a KV connector (:mod:`kvserve.kv_transfer.connector`) for a prefill or decode
    worker; the runner must then be a :class:`~kvserve.engine.runner.ConnectedRunner`
    (it has ``set_kv_connector``). None: a single-process engine.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: ModelInfo | None = None,
        runner: Runner | None = None,
        clock: Callable[[], float] = time.time,
        kv_connector: KVConnector | None = None,
    ) -> None:
        if runner is not None and loaded is None:
            raise TypeError(
                "EngineCore(runner=...) needs loaded= too: the tokenizer, EOS ids and context "
                "length of the model the runner runs"
            )
        if runner is None:
            tune_allocator()  # step-sized buffers stay in the heap (engine/allocator.py)
        if loaded is None:
            # Imported here so that torch is only loaded by engines, not by the CLI's help.
            from kvserve.model.loader import load_model

            loaded = load_model(
                config.model.model,
                dtype=config.model.dtype,
                device=config.model.device,
                quantization=config.model.quantization,
            )
        config = with_max_model_len(config, loaded.max_model_len)
        self.config = config
        self.loaded = loaded
        self.tokenizer: Any = loaded.tokenizer
        self.model_name: str = loaded.name
        self.max_model_len: int = config.scheduler.model_len
        self.eos_token_ids: list[int] = list(loaded.eos_token_ids)
        self.vocab_size: int = loaded.vocab_size
        self.limits = RequestLimits(
            self.max_model_len, self.vocab_size, config.scheduler.max_num_seqs
        )
        self.grammar_compiler = GrammarCompiler(
            loaded.tokenizer,
            loaded.vocab_size,
            self.eos_token_ids[0] if self.eos_token_ids else None,
        )
        self.runner: Runner = (
            runner if runner is not None else model_runner(config, loaded, self.grammar_compiler)
        )
        fingerprint = kv_fingerprint(loaded, self.runner)
        # The disk KV tier (kvserve.kv_offload), None unless kv_offload_dir is set.
        self.kv_offload = kv_offload_tier(config, self.runner, fingerprint)
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_kv_blocks,
            config.cache.block_size,
            self.max_model_len,
            enable_caching=config.cache.enable_prefix_caching,
            hash_algo=config.cache.hash_algo,
            model_fingerprint=fingerprint,
            kv_tier=self.kv_offload,
        )
        self.kv_connector = kv_connector
        if kv_connector is not None:
            if not isinstance(self.runner, ConnectedRunner):
                raise TypeError(
                    f"EngineCore(kv_connector=...) needs a runner with set_kv_connector; "
                    f"{type(self.runner).__name__} has none"
                )
            self.runner.set_kv_connector(kv_connector)
        self.scheduler = make_scheduler(
            config.scheduler, self.kv_cache_manager, kv_connector=kv_connector, clock=clock
        )
        self.scheduler.cost_model = step_cost_model(config, self.runner, loaded.vocab_size)
        # True when the last step computed nothing (e.g. only remote loads pending).
        self.last_step_idle = False
        fit = self.scheduler.max_running_requests
        if fit < config.scheduler.max_num_seqs:
            logger.warning(
                "%s policy: the KV cache holds only %d requests at max_model_len=%d, so at most "
                "%d will run at once (max_num_seqs=%d); lower max_model_len to what your requests need "
                "or give the KV cache more memory (kv_cache_memory_gib / num_kv_blocks)",
                config.scheduler.scheduler_policy,
                fit,
                self.max_model_len,
                fit,
                config.scheduler.max_num_seqs,
            )
        self._states: dict[str, RequestState] = {}
        # the runner's adapters (kvserve.lora.manager); None: LoRA is off
        self.lora_manager: LoRAManager | None = getattr(self.runner, "lora_manager", None)
        self._ids = itertools.count()
        self.num_failed_steps = 0

    # ------------------------------------------------------------------ requests
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`RequestError` (with the fix, and the field in ``param``) if this
        request can never be served (:func:`kvserve.engine.validation.validate_request`).
        Changes nothing."""
        validate_request(prompt_token_ids, params, self.limits, grammar=self.grammar_compiler)

    def _bad_word_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's token sequence, with and without a leading space (vLLM's rule)."""
        out: list[list[int]] = []
        for word in params.bad_words or ():
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return out

    def make_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> Request:
        """Validate (:meth:`validate_request`) and build a request for :meth:`add`:
        an id when none is given, ``max_tokens`` filled in when None. Changes no
        engine state, so any thread may call it. With ``n``/``best_of`` > 1 the
        result is sample 0, holding the other samples (``Request.group``, ids
        ``<id>#<i>``); :meth:`add` queues them all. ``truncate_prompt_tokens=k``
        keeps the prompt's last k tokens (the text is then dropped); ``bad_words``
        are tokenized here (``bad_words_token_ids``). ``lora_name``: a resident LoRA
        adapter (:class:`~kvserve.lora.errors.LoRAError` 404 when none has that name;
        400 when LoRA is off)."""
        k = params.truncate_prompt_tokens
        if k is not None and k < len(prompt_token_ids):
            prompt_token_ids, prompt = prompt_token_ids[-k:], None
        if params.bad_words and params.bad_words_token_ids is None:
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_word_ids(params))
        self.validate_request(prompt_token_ids, params)
        adapter_id = self._adapter_id(lora_name)
        if params.max_tokens is None:
            params = dataclasses.replace(
                params, max_tokens=self.max_model_len - len(prompt_token_ids)
            )
        request = Request(
            request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids,
            params,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            adapter_id=adapter_id,
            prompt=prompt,
        )
        request.lora_name = lora_name
        request.with_samples()
        return request

    def _adapter_id(self, lora_name: str | None) -> str | None:
        """The block-hash id of adapter ``lora_name`` (None: the base model)."""
        if lora_name is None:
            return None
        if self.lora_manager is None:
            raise LoRAError(
                f"the request selects LoRA adapter {lora_name!r} but this engine serves "
                "none: start it with --enable-lora (enable_lora=True)"
            )
        return self.lora_manager.resolve(lora_name).adapter_id

    def _drop(self, req_id: str) -> RequestState | None:
        """Forget a finished request's state (and its use of an adapter)."""
        state = self._states.pop(req_id, None)
        if state is not None and self.lora_manager is not None:
            self.lora_manager.release(req_id)
        return state

    def add(self, request: Request) -> str:
        """Queue a request built by :meth:`make_request` (not validated again); returns
        its id. Raises :class:`RequestError` and changes nothing when the id is in use
        or the request could never fit in the KV cache."""
        if any(r.req_id in self._states for r in request.group):
            raise RequestError(
                f"request id {request.req_id!r} is already in use: pick a unique id",
                param="request_id",
            )
        lora_name = getattr(request, "lora_name", None)
        if lora_name is not None and self.lora_manager is not None:
            taken: list[str] = []
            try:  # unloading waits for these requests (404 if it began meanwhile)
                for sample in request.group:
                    sample.adapter_id = self.lora_manager.acquire(sample.req_id, lora_name)
                    taken.append(sample.req_id)
                self.scheduler.add_request(request)
            except Exception:
                for req_id in taken:
                    self.lora_manager.release(req_id)
                raise
        else:
            self.scheduler.add_request(request)
        shared: list[Logprobs | None] | None = None
        if request.sampling_params.prompt_logprobs is not None:
            shared = [None] * request.num_prompt_tokens
        for sample in request.group:
            detok = IncrementalDetokenizer(
                self.tokenizer, sample.prompt_token_ids, sample.sampling_params
            )
            self._states[sample.req_id] = RequestState(sample, detok, shared)
        return request.req_id

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> str:
        """:meth:`make_request` then :meth:`add`: queue a request and return its id.
        Raises :class:`RequestError` (a ValueError) and changes nothing on bad input."""
        return self.add(
            self.make_request(
                prompt_token_ids,
                params,
                request_id=request_id,
                prompt=prompt,
                cache_salt=cache_salt,
                arrival_time=arrival_time,
                lora_name=lora_name,
            )
        )

    def abort_requests(self, req_ids: list[str] | str) -> list[RequestDelta]:
        """Finish these requests as aborted and free their blocks now; unknown or
        finished ids are ignored. Returns one finished delta (``finish_reason``
        "abort", no new tokens) per request aborted."""
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        live = [r for r in req_ids if r in self._states]
        if not live:
            return []
        self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        return [make_delta(self._pop(r).request, FinishReason.ABORT) for r in live]

    def _pop(self, req_id: str) -> RequestState:
        state = self._drop(req_id)
        assert state is not None  # callers checked req_id is live
        return state

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestDelta]:
        """Run one scheduler step; return the news for every request that advanced."""
        failed = self.poll_kv_transfer()
        t0 = time.perf_counter()  # the step's time, for the cost model's online correction
        sched_out = self.scheduler.schedule()
        self.last_step_idle = sched_out.is_empty
        if (
            sched_out.is_empty
            and not (sched_out.finished_req_ids or sched_out.block_copies)
            and sched_out.kv_connector_metadata is None
        ):
            return failed
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
            return failed + self.abort_requests(list(sched_out.num_scheduled_tokens))
        if sched_out.is_empty:
            runner_out = ModelRunnerOutput(sampled_token_ids={})
        for req_id, (start, entries) in runner_out.prompt_logprobs.items():
            state = self._states.get(req_id)
            if state is not None and state.prompt_logprobs is not None:
                # entry j scores prompt token start + j + 1 (a recomputed chunk overwrites)
                state.prompt_logprobs[start + 1 : start + 1 + len(entries)] = entries
        # Requests the runner cannot go on with end with an error before the update,
        # which then skips them (their sampled token is dropped, never a "stop").
        for req_id, error in runner_out.failed.items():
            gone = self._drop(req_id)
            if gone is not None:
                self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
                failed.append(make_delta(gone.request, FinishReason.ERROR, error=error))
        core_outs = self.scheduler.update_from_output(sched_out, runner_out)
        if self.scheduler.cost_model is not None and not sched_out.is_empty:
            self._observe_step(self.scheduler.cost_model, sched_out, runner_out, t0)
        deltas: list[RequestDelta] = failed
        for out in core_outs:
            state = self._states.get(out.req_id)
            if state is None:
                continue
            delta = process_output(state, out, self.scheduler)
            if delta.finished:
                self._drop(out.req_id)
            deltas.append(delta)
        return deltas

    def _observe_step(
        self, model: CostModel, so: SchedulerOutput, out: ModelRunnerOutput, t0: float
    ) -> None:
        """Feed the step's measured time (schedule + execute + update) to the cost model."""
        ms = (time.perf_counter() - t0) * 1e3
        rows = output_rows(
            so.num_scheduled_tokens,
            so.cached_seq_len,
            out.sampled_token_ids,
            so.num_scheduled_tokens_padded,
            so.decode_batch_size_padded,
        )
        spec = so.scheduled_spec_decode_tokens  # verification rows are decodes
        prompt_rows = output_rows(
            {r: n for r, n in so.num_scheduled_tokens.items() if r not in spec},
            so.cached_seq_len,
            out.sampled_token_ids,
            so.num_scheduled_tokens_padded,
        )
        predicted = model.observe(step_features(rows), ms, prompt_features(prompt_rows))
        if self.config.scheduler.step_trace:
            self._trace_step(so, ms, predicted, model)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "step %s: %d tokens, predicted %.1f ms, measured %.1f ms",
                so.phase,
                so.total_num_scheduled_tokens,
                predicted,
                ms,
            )

    def _trace_step(
        self, so: SchedulerOutput, ms: float, predicted: float, model: CostModel
    ) -> None:
        """Append the step's JSON line to ``step_trace`` (an unwritable path is logged
        once per step at warning level and never fails the step)."""
        line = {
            "t": round(time.time(), 6),
            "phase": so.phase,
            "measured_ms": round(ms, 3),
            "predicted_ms": round(predicted, 3),
            "scale": round(model.scale, 4),
            "prompt_scale": round(model.prompt_scale, 4),
            "rows": [[n, so.cached_seq_len.get(r, 0)] for r, n in so.num_scheduled_tokens.items()],
        }
        try:
            with open(self.config.scheduler.step_trace, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(line) + "\n")
        except OSError as e:
            logger.warning("step trace not written: %s", e)

    def poll_kv_transfer(self) -> list[RequestDelta]:
        """Apply finished KV transfers (free sent blocks, resume loaded requests) and
        return a finished delta, with ``error`` set, per request the connector
        failed. Cheap; call it also while idle (leases, claims). No-op without one."""
        if self.kv_connector is None:
            return []
        self.scheduler.poll_kv_connector()
        failed = self.scheduler.take_failed_requests()
        out = []
        for request, error in failed:
            if self._drop(request.req_id) is not None:
                out.append(make_delta(request, FinishReason.ABORT, error=error))
        return out

    # ------------------------------------------------------------------ health
    def stats(self) -> EngineStats:
        """Numbers for /metrics and logs (plain data)."""
        kv = self.kv_cache_manager
        sched = self.scheduler
        extra: dict[str, Any] = {
            **cost_model_stats(sched.cost_model),
            **offload_stats(self.kv_offload),
        }
        return EngineStats(
            num_requests_running=sched.num_running,
            num_requests_waiting=sched.num_waiting + len(sched.waiting_for_remote),
            num_requests_waiting_for_remote_kv=len(sched.waiting_for_remote),
            num_seqs_unfinished=len(sched.requests),
            kv_cache_usage_perc=kv.usage,
            num_active_blocks=kv.num_active_blocks,
            num_reclaimable_blocks=kv.num_reclaimable_blocks,
            num_empty_blocks=kv.num_empty_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            total_padding_tokens=sched.total_padding_tokens,
            scheduler_state=str(sched.state),
            num_failed_steps=self.num_failed_steps,
            spec_decode_num_drafts=sched.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=sched.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=sched.spec_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(
                sched.spec_stats.num_accepted_tokens_per_pos
            ),
            **extra,
        )

    def close(self) -> None:
        """Release what outlives a step: the KV offload tier's writer thread (its
        queued writes are finished first). Call once, after the last step; idempotent."""
        if self.kv_offload is not None:
            self.kv_offload.close()

    def check_no_leaks(self) -> None:
        """Raise RuntimeError if the KV cache's invariants are broken, or if blocks are
        still active while no request is unfinished."""
        self.kv_cache_manager.check_invariants()
        if (
            not self.has_unfinished_requests()
            and not self.scheduler.sending
            and self.kv_cache_manager.num_active_blocks
        ):
            raise RuntimeError(
                f"KV leak: {self.kv_cache_manager.num_active_blocks} blocks active with no request running"
            )
