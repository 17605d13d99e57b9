"""Block hash chain: determinism, chaining, tagged extra keys, cross-process stability."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve.kv_cache.hashing import (
    BlockHash,
    canonical_bytes,
    hash_block_tokens,
    model_fingerprint,
    request_extra_keys,
)

TOKENS = list(range(16))

# Pinned values: if the canonical encoding changes, caches of running workers stop
# agreeing, so a change here must be deliberate.
GOLDEN_BLOCK = "91c38b2667e5c91cafad7596bf2374bc0f76b18a8287ba1e4218b04bb308b12a"
GOLDEN_FINGERPRINT = "dc1e34372b015ba30963195297a63aa88968c8d53732ceddc6a38ee599b06abb"


def chain(
    tokens: list[int], block_size: int, extra: tuple = (), algo: str = "sha256"
) -> list[BlockHash]:
    out: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(
            parent, tokens[i * block_size : (i + 1) * block_size], extra if i == 0 else (), algo
        )
        out.append(parent)
    return out


def test_golden_values() -> None:
    assert hash_block_tokens(None, TOKENS, (("model", "m"),)).hex() == GOLDEN_BLOCK
    assert model_fingerprint("w", "float32", {"rope_theta": 10000.0}) == GOLDEN_FINGERPRINT


def test_sha256_is_32_bytes_and_deterministic() -> None:
    h = hash_block_tokens(None, TOKENS)
    assert isinstance(h, bytes) and len(h) == 32
    assert h == hash_block_tokens(None, tuple(TOKENS))


def test_any_token_change_changes_the_hash() -> None:
    base = hash_block_tokens(None, TOKENS)
    for i in range(16):
        changed = list(TOKENS)
        changed[i] += 1
        assert hash_block_tokens(None, changed) != base


def test_parent_changes_the_hash() -> None:
    p1 = hash_block_tokens(None, TOKENS)
    p2 = hash_block_tokens(None, [t + 1 for t in TOKENS])
    assert hash_block_tokens(p1, TOKENS) != hash_block_tokens(p2, TOKENS)
    assert hash_block_tokens(None, TOKENS) != hash_block_tokens(p1, TOKENS)


def test_early_change_propagates_down_the_chain() -> None:
    tokens = list(range(100, 164))
    mutated = list(tokens)
    mutated[5] = 999_999
    a, b = chain(tokens, 16), chain(mutated, 16)
    assert len(a) == len(b) == 4
    # blocks 1..3 have identical tokens, yet every hash differs through the chain
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_extra_keys_reach_later_blocks_through_the_chain() -> None:
    tokens = list(range(64))
    plain = chain(tokens, 16)
    salted = chain(tokens, 16, (("cache_salt", "tenant-a"),))
    assert all(x != y for x, y in zip(plain, salted, strict=True))


def test_tagged_extra_keys_do_not_collide() -> None:
    variants = [
        (),
        (("cache_salt", "x"),),
        (("adapter", "x"),),
        (("model", "x"),),
        (("cache_salt", "xy"),),
        (("cache_salt", "x"), ("adapter", "y")),
        (("adapter", "y"), ("cache_salt", "x")),
        (("cache_saltx", ""),),
        (("cache_salt", ""),),
        (("cache_salt", "1"),),
        (("cache_salt", 1),),
        (("a", "bc"),),
        (("ab", "c"),),
        (("a", "b", "c"),),
        ("a", "bc"),
    ]
    hashes = {hash_block_tokens(None, TOKENS, v) for v in variants}
    assert len(hashes) == len(variants)


def test_extra_keys_cannot_be_confused_with_tokens() -> None:
    # tokens [0..15] with a key must differ from tokens shifted into the key position
    a = hash_block_tokens(None, [1, 2], (("t", "3"),))
    b = hash_block_tokens(None, [1, 2, 3], ())
    assert a != b
    assert canonical_bytes("ab") != canonical_bytes(b"ab")
    assert canonical_bytes(("a", "b")) != canonical_bytes(("ab",))
    assert canonical_bytes(1) != canonical_bytes(True) != canonical_bytes(1.0)


def test_request_extra_keys() -> None:
    assert request_extra_keys("", None, None) == ()
    assert request_extra_keys("fp", None, None) == (("model", "fp"),)
    assert request_extra_keys("fp", "lora1", "s") == (
        ("model", "fp"),
        ("adapter", "lora1"),
        ("cache_salt", "s"),
    )
    # an empty salt is a salt of its own, not "no salt"
    assert request_extra_keys("fp", None, "") != request_extra_keys("fp", None, None)


def test_model_fingerprint() -> None:
    fp = model_fingerprint("weights:abc", "float32", 10000.0)
    assert fp == model_fingerprint("weights:abc", "float32", 10000.0)
    assert fp != model_fingerprint("weights:abc", "bfloat16", 10000.0)
    assert fp != model_fingerprint("weights:abc", "float32", 500000.0)
    assert fp != model_fingerprint("float32", "weights:abc", 10000.0)
    assert model_fingerprint({"a": 1, "b": 2}) == model_fingerprint({"b": 2, "a": 1})
    with pytest.raises(ValueError, match="cannot hash a value of type object"):
        model_fingerprint(object())


def test_builtin_algo_is_an_option_with_chaining() -> None:
    a = chain(list(range(64)), 16, algo="builtin")
    b = chain(list(range(64)), 16, (("cache_salt", "s"),), algo="builtin")
    assert len({*a, *b}) == 8
    assert all(len(h) == 8 for h in a)


def test_unknown_algo_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown hash_algo='md5'"):
        hash_block_tokens(None, TOKENS, (), "md5")


_CHILD = """
from kvserve.kv_cache.hashing import hash_block_tokens, model_fingerprint, request_extra_keys
fp = model_fingerprint("weights:abc", "float32", {"rope_theta": 10000.0})
keys = request_extra_keys(fp, "lora", "tenant")
p = None
for i in range(4):
    p = hash_block_tokens(p, list(range(i * 16, i * 16 + 16)), keys if i == 0 else (), "%s")
print(p.hex())
"""


def _hash_in_subprocess(algo: str, seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    res = subprocess.run(
        [sys.executable, "-c", _CHILD % algo], env=env, capture_output=True, text=True, check=True
    )
    return res.stdout.strip()


def test_sha256_is_stable_across_processes() -> None:
    fp = model_fingerprint("weights:abc", "float32", {"rope_theta": 10000.0})
    here = chain(list(range(64)), 16, request_extra_keys(fp, "lora", "tenant"))[-1].hex()
    assert _hash_in_subprocess("sha256", "1") == here
    assert _hash_in_subprocess("sha256", "2") == here


def test_builtin_is_not_stable_across_processes() -> None:
    # documents why builtin is not the default: string hashing is seeded per process
    assert _hash_in_subprocess("builtin", "1") != _hash_in_subprocess("builtin", "2")
