"""Bucket defaults, validation and lookup (``kvserve.buckets``)."""

from __future__ import annotations

import pytest

from kvserve.buckets import (
    default_num_batched_tokens_buckets,
    default_num_seqs_buckets,
    get_bucket,
    validate_buckets,
)

SEED_BUCKETS = [128, 256, 512, 1024, 2048, 4096, 8192]


def test_default_prefill_buckets_are_powers_of_two_from_128_to_the_effective_max():
    assert default_num_batched_tokens_buckets(8192, 131072) == SEED_BUCKETS
    # The effective max is min(max_num_batched_tokens, max_model_len).
    assert default_num_batched_tokens_buckets(16384, 8192) == SEED_BUCKETS
    assert default_num_batched_tokens_buckets(1000, 8192) == [128, 256, 512, 1000]
    assert default_num_batched_tokens_buckets(128, 8192) == [128]
    assert default_num_batched_tokens_buckets(64, 8192) == [64]


def test_default_decode_buckets_end_at_max_num_seqs():
    assert default_num_seqs_buckets(8) == [1, 2, 4, 8]
    assert default_num_seqs_buckets(6) == [1, 2, 4, 6]
    assert default_num_seqs_buckets(1) == [1]


@pytest.mark.parametrize(
    ("n", "bucket"),
    [(50, 128), (127, 128), (128, 128), (129, 256), (1500, 2048), (5000, 8192), (8192, 8192)],
)
def test_smallest_bucket_that_holds_the_chunk(n, bucket):
    assert get_bucket(n, SEED_BUCKETS) == bucket


def test_decode_batch_of_three_pads_to_four():
    assert get_bucket(3, [1, 2, 4, 8]) == 4
    assert [get_bucket(n, [1, 2, 4, 8]) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_bucket_lookup_edges():
    assert get_bucket(0, SEED_BUCKETS) == 0
    with pytest.raises(ValueError, match="larger than the last bucket 8192"):
        get_bucket(8193, SEED_BUCKETS)
    with pytest.raises(ValueError, match="must be >= 0"):
        get_bucket(-1, SEED_BUCKETS)


def test_valid_buckets_pass():
    validate_buckets("num_batched_tokens_buckets", [512, 1024, 2048, 4096, 8192], 8192, "x")
    validate_buckets("num_seqs_buckets", (1, 2, 4, 8), 8, "x")


@pytest.mark.parametrize(
    ("buckets", "message"),
    [
        ([512, 1024, 2048], "the last bucket must equal min.* got 2048"),
        ([1024, 512, 8192], "strictly ascending, but 512 follows 1024"),
        ([512, 512, 8192], "strictly ascending, but 512 follows 512"),
        ([0, 8192], "positive integer, got 0"),
        ([128, 256.0, 8192], "positive integer, got 256.0"),
        ([], "at least one bucket"),
        ("128,8192", "list of integers"),
    ],
)
def test_invalid_buckets_are_refused_with_value_rule_and_example(buckets, message):
    with pytest.raises(ValueError, match=message) as info:
        validate_buckets(
            "num_batched_tokens_buckets",
            buckets,
            8192,
            "min(max_num_batched_tokens, max_model_len) = 8192",
        )
    text = str(info.value)
    assert "num_batched_tokens_buckets=" in text
    assert "for example: num_batched_tokens_buckets=[1024, 2048, 4096, 8192]" in text
