"""What the engine hands out: per-step deltas for streaming, whole outputs, stats.

``RequestDelta`` is what one engine step produced for one request (new token ids
and the new text they decode to); ``RequestOutput`` is the vLLM-shaped
accumulated result that ``LLM.generate`` returns; ``EngineStats`` is the snapshot
``/metrics`` and logs read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.request import FinishReason
from kvserve.sched.output import Logprobs


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (seconds since the epoch); None until they happen."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # the step that produced the newest token
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    """One sample of a request. ``cumulative_logprob`` is the sum of its tokens'
    logprobs when they were computed (``logprobs`` or ``best_of`` set), else None."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # With SamplingParams(prompt_logprobs=k): None for the first prompt token, then
    # the logprob (and top k) of each prompt token given those before it.
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass
class RequestDelta:
    """One step's news for one sample of a request (for streaming).

    ``sample_index`` is the sample's index among the request's ``n``/``best_of``;
    ``prompt_logprobs`` (requests with ``prompt_logprobs`` set) comes on each
    sample's first delta that has tokens, the same list for every sample."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Prompt tokens whose KV came from a prefill worker (kv_transfer).
    num_external_tokens: int = 0
    # Set when the engine ended the request on an error (a failed KV transfer under
    # --kv-load-failure-policy fail); finish_reason is then "abort".
    error: str | None = None
    sample_index: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine's state (``EngineCore.stats()``); plain data, safe to
    read from any thread. Counts are since the engine started."""

    num_requests_running: int = 0
    # Waiting to be scheduled, including requests whose prompt KV is still arriving
    # from a prefill worker (decode role; also in num_requests_waiting_for_remote_kv).
    num_requests_waiting: int = 0
    num_requests_waiting_for_remote_kv: int = 0
    # Every unfinished sequence: running, waiting, samples not yet forked (admission).
    num_seqs_unfinished: int = 0
    kv_cache_usage_perc: float = 0.0  # 0 to 1; 1 = full
    num_active_blocks: int = 0
    num_reclaimable_blocks: int = 0
    num_empty_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    total_padding_tokens: int = 0
    scheduler_state: str = "IDLE"
    num_failed_steps: int = 0
    # Step-time cost model (0 without one): the last step's predicted and measured
    # milliseconds, and an exponentially weighted mean of |predicted - measured| / measured.
    step_predicted_ms: float = 0.0
    step_measured_ms: float = 0.0
    step_time_abs_error: float = 0.0
    # speculative decoding (kvserve.sched.spec_stats), cumulative
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # KV offload tier (kvserve.kv_offload; 0 without one), cumulative but the last two
    kv_offload_hits: int = 0  # blocks loaded back into the cache
    kv_offload_bytes_read: int = 0
    kv_offload_bytes_written: int = 0
    kv_offload_read_seconds: float = 0.0
    kv_offload_reads: int = 0
    kv_offload_errors: int = 0  # files skipped: corrupt, truncated, foreign
    kv_offload_writes_dropped: int = 0
    kv_offload_disk_bytes: int = 0  # gauge
    kv_offload_files: int = 0  # gauge
