"""Frozen configuration dataclasses. ``validate()`` raises ValueError with the fix.

Every engine option lives in exactly one of these; the CLI, ``LLM(...)`` and the
server all build an :class:`EngineConfig` and call :meth:`EngineConfig.validate`.
"""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from kvserve.buckets import (
    default_num_batched_tokens_buckets,
    default_num_seqs_buckets,
    max_prefill_bucket,
    validate_buckets,
)
from kvserve.checks import check_int as check_int  # re-exported
from kvserve.checks import config_error as config_error
from kvserve.checks import is_int as is_int
from kvserve.lora.config import LoRAConfig
from kvserve.speculative_config import SpeculativeConfig

SchedulerPolicy = Literal["mixed", "separated"]
HashAlgo = Literal["sha256", "builtin"]
# --kv-cache-dtype choices (vLLM's names; "fp8" is accepted as fp8_e4m3)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3", "int8")
VALID_KV_SEGMENT_SIZES = (0, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: the one owner of ``block_size`` and ``enable_prefix_caching``
    (the scheduler reads them from its KV cache manager, the runner from here).

    ``num_kv_blocks`` counts the null block 0, so ``num_kv_blocks - 1`` blocks are
    usable. When None, the model runner derives it from ``kv_cache_memory_gib``, and
    when that is None too (the default) sizes the cache itself: room for
    ``AUTO_KV_TOKENS`` tokens, at least 1 GiB, at most half the memory available after
    the weights (``kvserve.worker.model_runner.auto_kv_cache_bytes``), and logs it.
    ``hash_algo`` is "sha256" (default, stable across processes) or "builtin"
    (Python's hash of a tuple: faster, not stable across processes).
    ``kv_segment_size``: one of 0 (off), 512, 1024, 2048, 4096 and, when not 0, a
    multiple of ``block_size``; the model runner's attention reads prior KV in
    segments of it (prefill chunks need NOT equal it). The scheduler never reads it.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    enable_prefix_caching: bool = True
    hash_algo: HashAlgo = "sha256"
    # how K/V are stored: "auto" (the model dtype), "bfloat16", "float32", or 8-bit
    # "int8" / "fp8_e4m3" (kvserve.model.kernels.kv8; docs/quantization.md)
    kv_cache_dtype: str = "auto"
    # prior KV is read in segments of this many tokens (0: one pass), an attention
    # kernel setting read by the model runner only (kvserve.model.attention)
    kv_segment_size: int = 512
    # CPU KV pool memory: "eager" reserves and zeroes it at startup (huge pages where
    # granted), "lazy" maps it and commits each page when a block is first written
    # (kvserve.model.lazy_memory): the size is then a ceiling, not a reservation.
    # --gpu-memory-utilization sizes a lazy pool.
    kv_cache_commit: str = "eager"

    # KV tier beyond RAM (kvserve.kv_offload, docs/kv-offload.md): full prefix-cache
    # blocks are written to this directory and loaded back on a prefix hit, also after
    # a restart; None or "" = off. kv_offload_gib: the directory's budget (LRU files
    # are deleted past it).
    kv_offload_dir: str | None = None
    kv_offload_gib: float = 10.0

    def validate(self) -> None:
        check_int("block_size", self.block_size, "block_size=16")
        if self.kv_offload_dir is not None and not isinstance(self.kv_offload_dir, str):
            raise config_error(
                "kv_offload_dir",
                self.kv_offload_dir,
                "must be a directory path",
                "kv_offload_dir='/var/cache/kvserve' (--kv-offload-dir /var/cache/kvserve)",
            )
        gib = self.kv_offload_gib
        if isinstance(gib, bool) or not isinstance(gib, int | float) or not gib > 0:
            raise config_error(
                "kv_offload_gib", gib, "must be > 0", "kv_offload_gib=10 (--kv-offload-gib 10)"
            )
        if self.kv_offload_dir:
            if not self.enable_prefix_caching:
                raise config_error(
                    "kv_offload_dir",
                    self.kv_offload_dir,
                    "needs the prefix cache, which is off",
                    "drop --no-enable-prefix-caching, or drop --kv-offload-dir",
                )
            if self.hash_algo != "sha256":
                raise config_error(
                    "kv_offload_dir",
                    self.kv_offload_dir,
                    "needs hash_algo='sha256' (builtin hashes differ in every process, so "
                    "files would never match after a restart)",
                    "--hash-algo sha256",
                )
        if self.kv_cache_commit not in ("eager", "lazy"):
            raise config_error(
                "kv_cache_commit",
                self.kv_cache_commit,
                "must be 'eager' or 'lazy'",
                "kv_cache_commit='lazy' (--kv-cache-commit lazy)",
            )
        if self.block_size & (self.block_size - 1):
            raise config_error(
                "block_size", self.block_size, "must be a power of two", "16, 32 or 128"
            )
        if self.num_kv_blocks is not None:
            check_int(
                "num_kv_blocks",
                self.num_kv_blocks,
                "num_kv_blocks=1024",
                minimum=2,
                why=" (block 0 is the null block)",
            )
        kv_gib = self.kv_cache_memory_gib
        if kv_gib is not None and (
            isinstance(kv_gib, bool) or not isinstance(kv_gib, int | float) or kv_gib <= 0
        ):
            raise config_error(
                "kv_cache_memory_gib",
                self.kv_cache_memory_gib,
                "must be > 0",
                "kv_cache_memory_gib=1.0",
            )
        if self.hash_algo not in ("sha256", "builtin"):
            raise config_error(
                "hash_algo", self.hash_algo, "must be 'sha256' or 'builtin'", "hash_algo='sha256'"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise config_error(
                "enable_prefix_caching",
                self.enable_prefix_caching,
                "must be True or False",
                "enable_prefix_caching=True",
            )
        if self.kv_cache_dtype not in (*KV_CACHE_DTYPES, "fp8"):
            raise config_error(
                "kv_cache_dtype",
                self.kv_cache_dtype,
                f"must be one of {', '.join(KV_CACHE_DTYPES)}",
                "kv_cache_dtype='int8' (--kv-cache-dtype int8)",
            )
        seg = self.kv_segment_size
        if isinstance(seg, bool) or seg not in VALID_KV_SEGMENT_SIZES:
            raise config_error(
                "kv_segment_size",
                seg,
                "must be one of 512, 1024, 2048, 4096 (or 0 = off)",
                "kv_segment_size=1024",
            )
        if seg and seg % self.block_size:
            raise config_error(
                "kv_segment_size",
                seg,
                f"must be a multiple of block_size={self.block_size}",
                f"kv_segment_size={max(512, self.block_size)} with block_size={self.block_size}",
            )


# Default token budget of a step (SchedulerConfig.max_num_batched_tokens): large enough
# that a step without decodes keeps both cores busy; steps with decodes are bounded by
# time (max_step_ms), not by this.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

# Default step-time target for steps that also decode (``SchedulerConfig.max_step_ms``).
# Measured 2026-12-01 (AMD Zen 5, bf16, vLLM's bench client, docs/step-budget.md): 300
# against 150 gave random 512->128 c16 232 vs 201 tok/s (p99 ITL 303 vs 167 ms) and the
# interference workload 157 vs 129 tok/s (p99 ITL 316 vs 185 ms, mean TTFT 3.9 vs 6.1 s),
# every p99 still under 0.3x vLLM-CPU's.
DEFAULT_MAX_STEP_MS = 300.0

# Step-time target of a step that decodes while its prompt work is only short prompts
# (``SchedulerConfig.short_prompt_step_ms``; docs/step-budget.md). Chosen from the step
# trace of the shared-prefix row (16 streams, 64-token prompts over a cached 1,024-token
# prefix arriving together): at 300 ms five such prompts shared each step with 10
# decodes, so p99 ITL was the full 300 ms against vLLM-CPU's 125 ms. On a virtual clock
# with the quiet machine's fitted cost model (benchmarks/step_budget_vsim.py, which
# reproduces that row: 262 tok/s, p99 ITL 300 ms), 90 ms gives p99 ITL 91 ms (98 ms with
# 10 % step-time noise; 100 ms gives 101 / 109-115 ms) at 0.99x tok/s, and leaves the
# random, interference and multi-turn rows unchanged (no short-prompt-only steps there).
DEFAULT_SHORT_PROMPT_STEP_MS = 90.0

# ``SchedulerConfig.max_model_len`` at most, where the model's context is longer (and
# without a model: the simulator, a scheduler of its own).
DEFAULT_MAX_MODEL_LEN = 8192

# A burst wait (``AdmissionConfig.batch_wait_ms``) lasts at most this many times it.
BATCH_WAIT_MAX_FACTOR = 8


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling policy and budgets (names follow vLLM's).

    Bucket lists left as None get their defaults in ``kvserve.buckets``;
    ``resolved()`` returns a copy with them filled in (and validates first).
    ``validate()`` raises ValueError naming the value, the rule and a valid example:

    - ``max_num_seqs``, ``max_num_batched_tokens``: positive integers.
    - ``max_model_len``: positive integer, the longest prompt + output a request may
      have (the one owner of this limit: the engine, the KV cache manager and the
      runner read it from here). None (the default): the model's context length, at
      most ``DEFAULT_MAX_MODEL_LEN``, which the engine fills in before it resolves
      (:func:`kvserve.engine.args.with_max_model_len`); ``resolved()`` without a model
      (a scheduler of its own, the simulator) uses ``DEFAULT_MAX_MODEL_LEN``.
    - ``long_prefill_token_threshold``: integer >= 0 (0 = off).
    - ``prefill_budget_with_decodes``: integer >= 0 (0 = off). Mixed policy: in a
      step that also runs decodes, prompt chunks get at most this many tokens in all
      (the step's length is what every running stream waits between two tokens);
      steps without decodes still use all of ``max_num_batched_tokens``.
    - ``max_step_ms``: number >= 0 (0 = off). A step that also runs decodes gets only
      the prompt tokens that the engine's cost model (``kvserve.sched.cost_model``,
      fitted at startup) predicts fit in this many milliseconds beside the decodes,
      whatever the prompts' contexts; steps without decodes still use all of
      ``max_num_batched_tokens``. The separated policy picks its prefill bucket by the
      same model while decodes wait. Applies together with
      ``prefill_budget_with_decodes`` (both bounds hold); an engine without a cost
      model (a test's scheduler, an injected runner) uses the token bounds only.
    - ``short_prompt_step_ms``: number >= 0 (0 = off: ``max_step_ms`` for every
      prompt). Mixed policy under ``max_step_ms``: a prompt whose whole remaining work
      is predicted to take at most twice this long (``cost_model.LONG_PROMPT_FACTOR``)
      is a short prompt; while a step's prompt
      chunks are all short prompts, it is filled only up to this target (a long
      prompt's chunk in the step lifts it to ``max_step_ms``). Values above
      ``max_step_ms`` act as ``max_step_ms``.
    - ``step_cost_cache``: ``"auto"`` (reuse the cost model's fit persisted for this
      machine and model after a short check), ``"refresh"`` (calibrate, store) or
      ``"off"`` (calibrate, store nothing); ``kvserve.worker.step_cost``.
    - ``step_trace``: a file path, or ``""`` (off). Under ``max_step_ms`` the engine
      appends one JSON line per executed step to it (wall time, measured and predicted
      ms, the online factors, every row's new tokens and context): the step log that
      ``docs/step-budget.md`` reads. The file is opened per step, so it can be moved
      or removed while the engine runs.
    - ``scheduler_policy``: ``"mixed"`` or ``"separated"``.
    - The KV block size and prefix caching are the KV cache's (``CacheConfig``); the
      scheduler reads them from its KV cache manager.
    - ``num_batched_tokens_buckets``: strictly ascending positive integers whose last
      entry equals ``min(max_num_batched_tokens, max_model_len)``.
    - ``num_seqs_buckets``: strictly ascending positive integers whose last entry
      equals ``max_num_seqs``.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    scheduler_policy: SchedulerPolicy = "mixed"
    long_prefill_token_threshold: int = 0
    prefill_budget_with_decodes: int = 0
    max_step_ms: float = DEFAULT_MAX_STEP_MS
    short_prompt_step_ms: float = DEFAULT_SHORT_PROMPT_STEP_MS
    step_cost_cache: str = "auto"
    step_trace: str = ""
    num_batched_tokens_buckets: tuple[int, ...] | None = None
    num_seqs_buckets: tuple[int, ...] | None = None

    def validate(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, "max_num_seqs=64")
        check_int(
            "max_num_batched_tokens", self.max_num_batched_tokens, "max_num_batched_tokens=2048"
        )
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, "max_model_len=8192")
        if self.scheduler_policy not in ("mixed", "separated"):
            raise config_error(
                "scheduler_policy",
                self.scheduler_policy,
                "must be 'mixed' or 'separated'",
                "scheduler_policy='separated'",
            )
        check_int(
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            "long_prefill_token_threshold=256",
            minimum=0,
            why=" (0 = off)",
        )
        check_int(
            "prefill_budget_with_decodes",
            self.prefill_budget_with_decodes,
            "prefill_budget_with_decodes=1024",
            minimum=0,
            why=" (0 = off)",
        )
        step_ms = self.max_step_ms
        if (
            isinstance(step_ms, bool)
            or not isinstance(step_ms, int | float)
            or not 0 <= step_ms <= 60_000
        ):
            raise config_error(
                "max_step_ms",
                step_ms,
                "must be a number of milliseconds from 0 (off) to 60000",
                "max_step_ms=150",
            )
        short = self.short_prompt_step_ms
        if (
            isinstance(short, bool)
            or not isinstance(short, int | float)
            or not 0 <= short <= 60_000
        ):
            raise config_error(
                "short_prompt_step_ms",
                short,
                "must be a number of milliseconds from 0 (off) to 60000",
                "short_prompt_step_ms=100",
            )
        if self.step_cost_cache not in ("auto", "refresh", "off"):
            raise config_error(
                "step_cost_cache",
                self.step_cost_cache,
                "must be 'auto', 'refresh' or 'off'",
                "step_cost_cache='refresh'",
            )
        if self.num_batched_tokens_buckets is not None:
            last = max_prefill_bucket(self.max_num_batched_tokens, self.model_len)
            validate_buckets(
                "num_batched_tokens_buckets",
                self.num_batched_tokens_buckets,
                last,
                f"min(max_num_batched_tokens, max_model_len) = {last}",
            )
        if self.num_seqs_buckets is not None:
            validate_buckets(
                "num_seqs_buckets",
                self.num_seqs_buckets,
                self.max_num_seqs,
                f"max_num_seqs = {self.max_num_seqs}",
            )

    @property
    def model_len(self) -> int:
        """``max_model_len``, or ``DEFAULT_MAX_MODEL_LEN`` where it is None (unresolved)."""
        return DEFAULT_MAX_MODEL_LEN if self.max_model_len is None else self.max_model_len

    def resolved(self) -> SchedulerConfig:
        """Validate, then return a copy with default bucket lists filled in (as tuples)
        and ``max_model_len`` set (None: ``DEFAULT_MAX_MODEL_LEN``).

        Validation runs once per distinct configuration: a configuration resolved
        before (or the result of ``resolved()``) is looked up, not checked again, so
        the engine, the scheduler and the simulator may all call this."""
        key = _resolve_key(self)
        try:
            return _RESOLVED[key]
        except (KeyError, TypeError):  # TypeError: an unhashable (invalid) field
            pass
        self.validate()
        prefill = self.num_batched_tokens_buckets
        decode = self.num_seqs_buckets
        resolved = replace(
            self,
            max_model_len=self.model_len,
            num_batched_tokens_buckets=tuple(
                prefill
                if prefill is not None
                else default_num_batched_tokens_buckets(self.max_num_batched_tokens, self.model_len)
            ),
            num_seqs_buckets=tuple(
                decode if decode is not None else default_num_seqs_buckets(self.max_num_seqs)
            ),
        )
        if len(_RESOLVED) >= _RESOLVED_MAX:
            _RESOLVED.clear()
        _RESOLVED[_resolve_key(resolved)] = resolved
        with suppress(TypeError):  # list-valued bucket fields: only the copy is kept
            _RESOLVED[key] = resolved
        return resolved


# Configurations resolved so far (see SchedulerConfig.resolved); bounded. The key
# holds each field's type too: True == 1 and 1.0 == 1, but only 1 is a valid count.
_RESOLVED: dict[tuple[object, ...], SchedulerConfig] = {}
_RESOLVED_MAX = 256


def _resolve_key(config: SchedulerConfig) -> tuple[object, ...]:
    values = [getattr(config, f.name) for f in fields(config)]
    return (*values, *(type(v) for v in values))


@dataclass(frozen=True)
class AdmissionConfig:
    """How the server's engine front (:class:`~kvserve.engine.async_engine.AsyncEngine`,
    :mod:`kvserve.engine.request_limits`) hands requests to the engine core; the scheduler
    never reads it.

    - ``batch_wait_ms``: number from 0 (off) to 1000. An engine that was idle waits,
      before its first step, until no new request has arrived for this long (at most
      ``BATCH_WAIT_MAX_FACTOR`` times it), and adds reaching a busy engine are held
      until their burst stops arriving, so a burst's requests, which the front end
      hands over one by one as it parses and tokenizes them, start as one batch.
    """

    batch_wait_ms: float = 10.0

    def validate(self) -> None:
        wait = self.batch_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 1000:
            raise config_error(
                "batch_wait_ms", wait, "must be a number from 0 (off) to 1000", "batch_wait_ms=10"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Which model and how to run it. ``model`` is a path, a .gguf file or a named default."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # bfloat16 where the CPU has native bf16, else float32
    # auto: run a quantized GGUF quantized; none: dequantize; int8/int4: quantize at load
    quantization: str = "auto"
    device: str = "cpu"
    compile: bool = False  # decode steps as torch.compile graphs, one per decode bucket
    # a row's logits bitwise independent of batch, chunking and cache (docs/determinism.md);
    # True: every length; None: automatic, positions below 512 where cheap (quantized or
    # bfloat16-panel linears, no AMX, not with compile); False: off
    batch_invariant: bool | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # Speculative decoding (None: off); see kvserve.speculative_config.
    speculative: SpeculativeConfig | None = None
    # Multi-LoRA serving (None: off); see kvserve.lora.config.
    lora: LoRAConfig | None = None
