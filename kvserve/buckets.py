"""Bucket lists for the separated policy: defaults, validation, smallest bucket >= n.

A bucket is a shape the model runner is prepared for. The separated policy pads every
prefill chunk to the smallest ``num_batched_tokens_buckets`` entry that holds it and
every decode batch to the smallest ``num_seqs_buckets`` entry that holds it::

    num_batched_tokens_buckets = [128, 256, 512, 1024, 2048, 4096, 8192]
    chunk of 1500 tokens -> 2048 (548 padding tokens)
    num_seqs_buckets = [1, 2, 4, 8]
    3 decodes -> batch of 4 (1 dummy row)

Rules a bucket list keeps (checked by :func:`validate_buckets`): positive integers,
strictly ascending, and the last entry equals the largest size that can occur
(``min(max_num_batched_tokens, max_model_len)`` for prefill, ``max_num_seqs`` for
decode), so every chunk or batch has a bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.checks import is_int

DEFAULT_MIN_PREFILL_BUCKET = 128


def _powers_of_two_up_to(start: int, last: int) -> list[int]:
    """``[start, 2*start, 4*start, ...]`` below ``last``, then ``last`` itself."""
    buckets: list[int] = []
    size = start
    while size < last:
        buckets.append(size)
        size *= 2
    buckets.append(last)
    return buckets


def max_prefill_bucket(max_num_batched_tokens: int, max_model_len: int) -> int:
    """The largest prefill chunk that can occur: ``min(max_num_batched_tokens, max_model_len)``."""
    return min(max_num_batched_tokens, max_model_len)


def default_num_batched_tokens_buckets(
    max_num_batched_tokens: int, max_model_len: int
) -> list[int]:
    """Powers of two from 128 up to ``min(max_num_batched_tokens, max_model_len)``.

    The last entry is always that minimum, even when it is not a power of two
    (1000 -> [128, 256, 512, 1000]); a minimum below 128 gives a single bucket.
    8192 -> [128, 256, 512, 1024, 2048, 4096, 8192].
    """
    last = max_prefill_bucket(max_num_batched_tokens, max_model_len)
    return _powers_of_two_up_to(DEFAULT_MIN_PREFILL_BUCKET, last)


def default_num_seqs_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two from 1 up to ``max_num_seqs`` (8 -> [1, 2, 4, 8]; 6 -> [1, 2, 4, 6])."""
    return _powers_of_two_up_to(1, max_num_seqs)


def validate_buckets(
    name: str, buckets: Sequence[int], required_last: int, rule_for_last: str
) -> None:
    """Raise ValueError naming ``name``, the bad value, the rule and a valid example.

    ``rule_for_last`` describes where ``required_last`` comes from, e.g.
    ``"min(max_num_batched_tokens, max_model_len) = 8192"``.
    """
    example = ", ".join(str(b) for b in _powers_of_two_up_to(1, required_last)[-4:])
    value = list(buckets) if not isinstance(buckets, str | bytes) else buckets
    if isinstance(buckets, str | bytes) or not isinstance(buckets, Sequence):
        raise ValueError(
            f"invalid {name}={value!r}: must be a list of integers "
            f"(for example: {name}=[{example}])"
        )
    if not buckets:
        raise ValueError(
            f"invalid {name}=[]: must hold at least one bucket (for example: {name}=[{example}])"
        )
    for b in buckets:
        if not is_int(b) or b < 1:
            raise ValueError(
                f"invalid {name}={value!r}: every bucket must be a positive integer, got {b!r} "
                f"(for example: {name}=[{example}])"
            )
    for a, b in zip(buckets, buckets[1:], strict=False):
        if b <= a:
            raise ValueError(
                f"invalid {name}={value!r}: buckets must be strictly ascending, but {b} follows {a} "
                f"(for example: {name}=[{example}])"
            )
    if buckets[-1] != required_last:
        raise ValueError(
            f"invalid {name}={value!r}: the last bucket must equal {rule_for_last}, got {buckets[-1]} "
            f"(for example: {name}=[{example}])"
        )


def get_bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket ``>= n``; 0 for ``n == 0``.

    ``buckets`` must be valid (ascending). Raises ValueError when ``n`` is negative
    or larger than the last bucket (the scheduler never asks for that).
    """
    if n < 0:
        raise ValueError(f"bucket lookup for n={n}: n must be >= 0")
    if n == 0:
        return 0
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(
        f"bucket lookup for n={n}: larger than the last bucket {buckets[-1] if buckets else None}"
    )
