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


def test_shared_options_reach_both_configs() -> None:
    cfg = build_engine_config(
        block_size=32, enable_prefix_caching=False, max_num_batched_tokens=256
    )
    assert cfg.cache.block_size == 32 and cfg.scheduler.block_size == 32
    assert cfg.cache.enable_prefix_caching is False and cfg.scheduler.enable_prefix_caching is False
    assert cfg.scheduler.max_num_batched_tokens == 256


def test_unknown_option_lists_valid_ones() -> None:
    with pytest.raises(TypeError, match="max_num_batched_tokens"):
        build_engine_config(max_batched_tokens=256)


def test_bad_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        build_engine_config(block_size=24)


def test_max_model_len_resolution() -> None:
    cfg = with_max_model_len(build_engine_config(), 8192)
    assert cfg.scheduler.max_model_len == 8192 and cfg.model.max_model_len == 8192
    cfg = with_max_model_len(
        build_engine_config(max_model_len=2048, max_num_batched_tokens=256), 8192
    )
    assert cfg.scheduler.max_model_len == 2048
    with pytest.raises(ValueError, match="at most 8192"):
        with_max_model_len(build_engine_config(max_model_len=100_000), 8192)


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
