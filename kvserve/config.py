"""Frozen configuration dataclasses. ``validate()`` raises ValueError with the fix.

Every engine option lives in exactly one of these; the CLI, ``LLM(...)`` and the
server all build an :class:`EngineConfig` and call :meth:`EngineConfig.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SchedulerPolicy = Literal["mixed", "separated"]
VALID_KV_SEGMENT_SIZES = (0, 512, 1024, 2048, 4096)


def config_error(name: str, value: object, rule: str, example: str) -> ValueError:
    """The one error shape for bad configuration: value, rule, valid example."""
    return ValueError(f"invalid {name}={value!r}: {rule} (for example: {example})")


def _positive_int(name: str, value: object, example: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise config_error(name, value, "must be a positive integer", example)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    ``num_kv_blocks`` counts the null block 0, so ``num_kv_blocks - 1`` blocks are
    usable. When None, the model runner derives it from ``kv_cache_memory_gib``.
    ``hash_algo`` is "sha256" (default, stable across processes) or "builtin"
    (Python's hash of a tuple: faster, not stable across processes).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"

    def validate(self) -> None:
        _positive_int("block_size", self.block_size, "block_size=16")
        if self.block_size & (self.block_size - 1):
            raise config_error("block_size", self.block_size, "must be a power of two", "16, 32 or 128")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2
        ):
            raise config_error(
                "num_kv_blocks", self.num_kv_blocks, "must be an integer >= 2 (block 0 is the null block)", "num_kv_blocks=1024"
            )
        if not isinstance(self.kv_cache_memory_gib, int | float) or self.kv_cache_memory_gib <= 0:
            raise config_error("kv_cache_memory_gib", self.kv_cache_memory_gib, "must be > 0", "kv_cache_memory_gib=1.0")
        if self.hash_algo not in ("sha256", "builtin"):
            raise config_error("hash_algo", self.hash_algo, "must be 'sha256' or 'builtin'", "hash_algo='sha256'")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling policy and budgets (names follow vLLM and the seed documents).

    Bucket lists left as None get their defaults in ``kvserve.sched.buckets``;
    ``resolved()`` returns a copy with them filled in.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192
    scheduler_policy: SchedulerPolicy = "mixed"
    long_prefill_token_threshold: int = 0
    num_batched_tokens_buckets: tuple[int, ...] | None = None
    num_seqs_buckets: tuple[int, ...] | None = None
    kv_segment_size: int = 512
    block_size: int = 16
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Which model and how to run it. ``model`` is a path, a .gguf file or a named default."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # None: min(model's context, 8192)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
