"""SchedulerConfig.validate()/resolved() and make_scheduler's refusals."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.config import (
    DEFAULT_MAX_MODEL_LEN,
    AdmissionConfig,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvserve.kv_cache import KVCacheManager
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.sched import MixedScheduler, SeparatedScheduler, decode_batch_buckets, make_scheduler


def test_each_policy_owns_the_decode_batch_sizes_it_pads_to():
    separated = SchedulerConfig(scheduler_policy="separated", max_num_seqs=8).resolved()
    assert separated.num_seqs_buckets is not None
    assert decode_batch_buckets(separated) == tuple(separated.num_seqs_buckets)
    assert decode_batch_buckets(dataclasses.replace(separated, num_seqs_buckets=(2, 8))) == (2, 8)
    # the mixed policy never pads a decode batch, whatever the bucket list says
    mixed = SchedulerConfig(scheduler_policy="mixed", max_num_seqs=8).resolved()
    assert mixed.num_seqs_buckets is not None and decode_batch_buckets(mixed) is None


def test_defaults_are_valid_and_resolved_fills_buckets():
    config = SchedulerConfig(max_num_batched_tokens=8192, max_model_len=131072, max_num_seqs=8)
    config.validate()
    resolved = config.resolved()
    assert resolved.num_batched_tokens_buckets == (128, 256, 512, 1024, 2048, 4096, 8192)
    assert resolved.num_seqs_buckets == (1, 2, 4, 8)
    assert config.num_batched_tokens_buckets is None  # frozen original untouched
    # Given buckets are kept (as tuples).
    custom = dataclasses.replace(config, num_seqs_buckets=[2, 8]).resolved()  # type: ignore[arg-type]
    assert custom.num_seqs_buckets == (2, 8)


def test_default_prefill_buckets_use_max_model_len_when_smaller():
    resolved = SchedulerConfig(max_num_batched_tokens=8192, max_model_len=2048).resolved()
    assert resolved.num_batched_tokens_buckets == (128, 256, 512, 1024, 2048)


@pytest.mark.parametrize(
    ("changes", "pieces"),
    [
        (
            {"num_batched_tokens_buckets": (512, 1024, 2048)},
            [
                "num_batched_tokens_buckets=[512, 1024, 2048]",
                "last bucket must equal",
                "8192",
                "for example",
            ],
        ),
        (
            {"num_batched_tokens_buckets": (1024, 512, 8192)},
            ["num_batched_tokens_buckets", "strictly ascending", "for example"],
        ),
        (
            {"num_seqs_buckets": (1, 2, 4)},
            [
                "num_seqs_buckets=[1, 2, 4]",
                "max_num_seqs = 8",
                "for example: num_seqs_buckets=[1, 2, 4, 8]",
            ],
        ),
        ({"num_seqs_buckets": (4, 2, 8)}, ["num_seqs_buckets", "strictly ascending"]),
        ({"scheduler_policy": "fifo"}, ["scheduler_policy='fifo'", "'mixed' or 'separated'"]),
        ({"max_num_seqs": 0}, ["max_num_seqs=0", "positive integer", "for example"]),
        ({"max_num_batched_tokens": -5}, ["max_num_batched_tokens=-5", "positive integer"]),
        ({"max_model_len": 0}, ["max_model_len=0", "positive integer"]),
        ({"long_prefill_token_threshold": -1}, ["long_prefill_token_threshold=-1", ">= 0"]),
    ],
)
def test_bad_configs_are_refused_naming_value_rule_and_example(changes, pieces):
    config = dataclasses.replace(
        SchedulerConfig(max_num_batched_tokens=8192, max_model_len=131072, max_num_seqs=8),
        **changes,
    )
    for call in (config.validate, config.resolved):
        with pytest.raises(ValueError) as info:
            call()
        for piece in pieces:
            assert piece in str(info.value), (piece, str(info.value))


@pytest.mark.parametrize(
    ("changes", "pieces"),
    [
        ({"kv_segment_size": 768}, ["kv_segment_size=768", "512, 1024, 2048, 4096", "for example"]),
        ({"kv_segment_size": 300}, ["kv_segment_size=300", "or 0 = off"]),
        (
            {"kv_segment_size": 512, "block_size": 1024},
            ["kv_segment_size=512", "multiple of block_size=1024", "for example"],
        ),
        ({"block_size": 24}, ["block_size=24", "power of two"]),
        ({"enable_prefix_caching": "yes"}, ["enable_prefix_caching='yes'", "True or False"]),
    ],
)
def test_bad_cache_configs_are_refused_naming_value_rule_and_example(changes, pieces):
    """The KV cache's fields (block size, prefix caching, the attention's segment size)
    are validated by their one owner, CacheConfig."""
    with pytest.raises(ValueError) as info:
        dataclasses.replace(CacheConfig(), **changes).validate()
    for piece in pieces:
        assert piece in str(info.value), (piece, str(info.value))


def test_each_field_has_one_owner():
    """No field name is in two of the engine's config classes (each is read from its one
    owner). SpeculativeConfig is left out: its ``model``/``quantization`` are the draft
    model's own, not the target's."""
    owners: dict[str, list[str]] = {}
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, AdmissionConfig, KVTransferConfig):
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, []).append(cls.__name__)
    assert {name: o for name, o in owners.items() if len(o) > 1} == {}


def test_prefill_bucket_need_not_equal_the_kv_segment_size():
    # The seed hardware's temporary rule is deliberately not copied.
    SchedulerConfig(max_num_batched_tokens=2048, num_batched_tokens_buckets=(128, 2048)).validate()
    CacheConfig(kv_segment_size=1024).validate()
    CacheConfig(kv_segment_size=0).validate()


def test_unset_max_model_len_resolves_to_the_default_without_a_model():
    resolved = SchedulerConfig().resolved()
    assert SchedulerConfig().max_model_len is None
    assert resolved.max_model_len == DEFAULT_MAX_MODEL_LEN == 8192
    assert resolved.num_batched_tokens_buckets[-1] == 2048


def test_make_scheduler_picks_the_policy_and_refuses_mismatches():
    kv = KVCacheManager(64, 16, 8192)
    assert isinstance(make_scheduler(SchedulerConfig(), kv), MixedScheduler)
    separated = make_scheduler(SchedulerConfig(scheduler_policy="separated"), kv)
    assert isinstance(separated, SeparatedScheduler)
    assert separated.num_seqs_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert separated.kv_cache_manager.block_size == 16  # the manager's, not a copy
    with pytest.raises(ValueError, match="max_model_len=16384.*at most 8192"):
        make_scheduler(SchedulerConfig(max_model_len=16384), kv)
    with pytest.raises(ValueError, match="num_seqs_buckets"):
        make_scheduler(SchedulerConfig(num_seqs_buckets=(1, 2)), kv)


def test_a_configuration_is_validated_once_per_value(monkeypatch) -> None:
    from kvserve.kv_cache import KVCacheManager
    from kvserve.sched import make_scheduler

    calls = []
    real = SchedulerConfig.validate
    monkeypatch.setattr(SchedulerConfig, "validate", lambda self: calls.append(1) or real(self))
    config = SchedulerConfig(max_num_seqs=7, max_model_len=1000)
    for _ in range(3):
        make_scheduler(config, KVCacheManager(100, 16, 1000))
    assert len(calls) == 1
    # a bool equals 1 but is no count: never served from what 1 resolved to
    SchedulerConfig(max_num_seqs=1, max_model_len=1000).resolved()
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=True, max_model_len=1000).resolved()
