"""Engine options: mapping onto configs and up-front validation (no model needed)."""

from __future__ import annotations

import argparse

import pytest

from kvserve.engine.args import (
    OPTION_NAMES,
    add_engine_arguments,
    build_engine_config,
    engine_kwargs_from_args,
    with_max_model_len,
)


def test_each_option_reaches_its_one_owner() -> None:
    cfg = build_engine_config(
        block_size=32,
        enable_prefix_caching=False,
        kv_segment_size=1024,
        max_model_len=4096,
        max_num_batched_tokens=256,
    )
    assert cfg.cache.block_size == 32 and not hasattr(cfg.scheduler, "block_size")
    assert cfg.cache.enable_prefix_caching is False
    assert not hasattr(cfg.scheduler, "enable_prefix_caching")
    assert cfg.cache.kv_segment_size == 1024 and not hasattr(cfg.scheduler, "kv_segment_size")
    assert cfg.scheduler.max_model_len == 4096 and not hasattr(cfg.model, "max_model_len")
    assert cfg.scheduler.max_num_batched_tokens == 256


def test_an_engine_validates_its_scheduler_config_once(monkeypatch) -> None:
    """One engine: with_max_model_len, make_scheduler and the scheduler all resolve the
    config; only the first validates it."""
    from kvserve import config as config_module
    from kvserve.config import SchedulerConfig
    from kvserve.engine.engine_core import EngineCore
    from kvserve.sim.runner import SimulatedModel, StandInRunner

    monkeypatch.setattr(config_module, "_RESOLVED", {})  # nothing resolved before
    calls: list[SchedulerConfig] = []
    real = SchedulerConfig.validate

    def counting(self: SchedulerConfig) -> None:
        calls.append(self)
        real(self)

    monkeypatch.setattr(SchedulerConfig, "validate", counting)
    config = build_engine_config(max_num_seqs=4, max_num_batched_tokens=256, num_kv_blocks=64)
    engine = EngineCore(config, loaded=SimulatedModel(2048), runner=StandInRunner(64))
    assert len(calls) == 1
    assert calls[0].max_model_len == 2048  # the resolved one, never the unset None
    assert engine.scheduler.config.max_model_len == 2048
    assert engine.kv_cache_manager.max_model_len == 2048
    assert engine.scheduler.kv_cache_manager.block_size == config.cache.block_size


def test_unknown_option_lists_valid_ones() -> None:
    with pytest.raises(TypeError, match="max_num_batched_tokens"):
        build_engine_config(max_batched_tokens=256)


def test_bad_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        build_engine_config(block_size=24)


def test_max_model_len_resolution() -> None:
    assert build_engine_config().scheduler.max_model_len is None  # unset: the model's
    cfg = with_max_model_len(build_engine_config(), 8192)
    assert cfg.scheduler.max_model_len == 8192
    assert with_max_model_len(build_engine_config(), 2048).scheduler.max_model_len == 2048
    assert with_max_model_len(build_engine_config(), 32768).scheduler.max_model_len == 8192
    cfg = with_max_model_len(
        build_engine_config(max_model_len=2048, max_num_batched_tokens=256), 8192
    )
    assert cfg.scheduler.max_model_len == 2048
    with pytest.raises(ValueError, match="at most 8192"):
        with_max_model_len(build_engine_config(max_model_len=100_000), 8192)


def test_an_engine_refuses_a_bad_cache_config() -> None:
    """An EngineConfig built by hand (not through build_engine_config) is checked too."""
    from kvserve.config import CacheConfig, EngineConfig

    for bad in (CacheConfig(block_size=24), CacheConfig(kv_segment_size=300)):
        with pytest.raises(ValueError, match="block_size=24|kv_segment_size=300"):
            with_max_model_len(EngineConfig(cache=bad), 8192)


def test_bad_scheduler_option_is_refused_up_front() -> None:
    cfg = build_engine_config(scheduler_policy="separated", num_seqs_buckets=(1, 2, 4))
    with pytest.raises(ValueError, match="num_seqs_buckets"):
        with_max_model_len(cfg, 8192)


def test_cli_flags_round_trip() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(
        [
            "--max-num-batched-tokens",
            "256",
            "--no-enable-prefix-caching",
            "--num-seqs-buckets",
            "1,2,4,8",
        ]
    )
    kwargs = engine_kwargs_from_args(args)
    assert kwargs == {
        "max_num_batched_tokens": 256,
        "enable_prefix_caching": False,
        "num_seqs_buckets": (1, 2, 4, 8),
    }
    assert set(kwargs) <= set(OPTION_NAMES)
