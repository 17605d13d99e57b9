"""Building an :class:`~kvserve.engine.engine_core.EngineCore`'s parts from its
config: the real model runner, the KV block-hash salt and the scheduler's step-time
model. Each imports torch-backed modules only when an engine needs them (the CLI's
help never loads torch)."""

from __future__ import annotations

from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.runner import CostedRunner, KVFormatRunner, ModelInfo, Runner
from kvserve.sched.cost_model import CostModel
from kvserve.structured.compiler import GrammarCompiler


def kv_fingerprint(loaded: ModelInfo, runner: Runner) -> str:
    """The block-hash salt: the model's fingerprint, and the KV cache format when it is
    not the model dtype (an int8 cache's blocks never match a bfloat16 one's)."""
    if not isinstance(runner, KVFormatRunner):
        return loaded.fingerprint
    return runner.kv_fingerprint(loaded.fingerprint)


def kv_offload_tier(config: EngineConfig, runner: Runner, fingerprint: str) -> Any:
    """The disk KV tier of ``config.cache.kv_offload_dir`` over the runner's KV cache
    (a :class:`~kvserve.kv_offload.tier.DiskKVTier`), or None when the option is off.
    ``fingerprint``: the engine's block-hash salt (:func:`kv_fingerprint`). A runner
    without a ``kv_cache`` tensor (the simulator's, test doubles) raises TypeError."""
    directory = config.cache.kv_offload_dir
    if not directory:
        return None
    kv_cache = getattr(runner, "kv_cache", None)
    if kv_cache is None:
        raise TypeError(
            f"kv_offload_dir needs a runner with a paged KV cache tensor; "
            f"{type(runner).__name__} has none: drop kv_offload_dir"
        )
    from kvserve.kv_offload.tier import DiskKVTier

    return DiskKVTier(
        kv_cache, directory, int(config.cache.kv_offload_gib * (1 << 30)), fingerprint
    )


def offload_stats(tier: Any) -> dict[str, Any]:
    """The tier's counters as ``EngineStats`` fields (no tier: {})."""
    if tier is None:
        return {}
    s = tier.stats()
    return {
        "kv_offload_hits": s.hits,
        "kv_offload_bytes_read": s.bytes_read,
        "kv_offload_bytes_written": s.bytes_written,
        "kv_offload_read_seconds": s.read_seconds,
        "kv_offload_reads": s.reads,
        "kv_offload_errors": s.errors,
        "kv_offload_writes_dropped": s.writes_dropped,
        "kv_offload_disk_bytes": s.disk_bytes,
        "kv_offload_files": s.num_files,
    }


def model_runner(
    config: EngineConfig, loaded: ModelInfo, grammar_compiler: GrammarCompiler
) -> Runner:
    """The real model runner (imported here: torch only loads when an engine needs it)."""
    from kvserve.model.loader import LoadedModel
    from kvserve.worker.model_runner import ModelRunner

    if not isinstance(loaded, LoadedModel):
        raise TypeError(
            f"EngineCore builds its ModelRunner from a LoadedModel, got {type(loaded).__name__}: "
            "pass runner= for any other model"
        )
    return ModelRunner(
        loaded,
        config.cache,
        config.scheduler,
        compile=config.model.compile,
        grammar_compiler=grammar_compiler,
        speculative_config=config.speculative,
        batch_invariant=config.model.batch_invariant,
        lora_config=config.lora,
    )


def cost_model_stats(model: CostModel | None) -> dict[str, float]:
    """The last step's predicted and measured time, for ``EngineStats`` (none yet: {})."""
    if model is None or not model.errors:
        return {}
    predicted, measured = model.errors[-1]
    return {
        "step_predicted_ms": predicted,
        "step_measured_ms": measured,
        "step_time_abs_error": model.abs_error_ewma,
    }


def step_cost_model(config: EngineConfig, runner: Runner, vocab_size: int) -> CostModel | None:
    """The scheduler's step-time model: None when ``max_step_ms`` is 0 or the runner
    has no ``step_cost_model`` (:class:`CostedRunner`: token budgets only); otherwise
    the runner's (the real one fits it now from timed steps)."""
    if not config.scheduler.max_step_ms or not isinstance(runner, CostedRunner):
        return None
    return runner.step_cost_model(vocab_size, config.scheduler.model_len)
