"""Block hash chain for prefix caching.

The hash of a full block depends on its parent block's hash, its token ids, and the
request's extra keys::

    root ──▶ H0 = h(ROOT, tokens[0:B],  extra_keys) ──▶ H1 = h(H0, tokens[B:2B]) ──▶ ...

Extra keys (model fingerprint, adapter, cache salt) go into the FIRST block only and
reach every later block through the chain, so two requests that differ in any key
share no block. Extra keys are tagged tuples such as ``("cache_salt", "tenant-a")``:
the tag names the kind of key, so a salt can never collide with an adapter id of the
same spelling.

The default algorithm, ``"sha256"``, hashes a canonical byte encoding (explicit
lengths, explicit little-endian integers, type tags) so the same block gets the same
hash in every process and on every machine; future prefill/decode workers must agree.
``"builtin"`` uses Python's ``hash`` of a tuple: faster, but strings and bytes are
hashed with a per-process random seed, so its values are not stable across processes.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from typing import get_args

from kvserve.config import HashAlgo
from kvserve.request import BlockHash as BlockHash  # re-exported: the KV cache's name for it

HASH_ALGOS: tuple[HashAlgo, ...] = get_args(HashAlgo)

# Parent of the first block: a fixed 32-byte value, never the hash of a real block.
_ROOT = hashlib.sha256(b"kvserve.block-hash-chain.root.v1").digest()


def _encode(value: object, out: bytearray) -> None:
    """Append an injective, type-tagged encoding of ``value`` to ``out``.

    Supported: None, bool, int, float, str, bytes, and tuples/lists/dicts of these
    (dicts are encoded with keys sorted by their encoding). Anything else raises
    ValueError, because ``repr`` of arbitrary objects is not stable across processes.
    """
    if value is None:
        out += b"N"
    elif isinstance(value, bool):
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        raw = str(value).encode("ascii")
        out += b"i" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, float):
        raw = value.hex().encode("ascii")
        out += b"f" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"s" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, bytes | bytearray):
        out += b"b" + struct.pack("<I", len(value)) + bytes(value)
    elif isinstance(value, tuple | list):
        out += b"t" + struct.pack("<I", len(value))
        for item in value:
            _encode(item, out)
    elif isinstance(value, dict):
        items = []
        for k, v in value.items():
            kb, vb = bytearray(), bytearray()
            _encode(k, kb)
            _encode(v, vb)
            items.append((bytes(kb), bytes(vb)))
        items.sort()
        out += b"d" + struct.pack("<I", len(items))
        for key_bytes, value_bytes in items:
            out += key_bytes + value_bytes
    else:
        raise ValueError(
            f"cannot hash a value of type {type(value).__name__} ({value!r}) stably: "
            "use str, int, float, bool, None, bytes, or tuples/lists/dicts of these, "
            "e.g. model_fingerprint('sha256:ab12...', 'float32', 10000.0)"
        )


def canonical_bytes(value: object) -> bytes:
    """The canonical, process-independent byte encoding used by the sha256 hashes."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


_EMPTY_KEYS = canonical_bytes(())


@functools.lru_cache(maxsize=64)
def _token_packer(num_tokens: int) -> struct.Struct:
    """Little-endian u32 count followed by ``num_tokens`` signed 64-bit token ids."""
    return struct.Struct(f"<I{num_tokens}q")


def model_fingerprint(*parts: object) -> str:
    """A stable hex string identifying everything that changes a block's KV contents.

    Pass the weights digest, dtype, RoPE settings (theta, scaling), KV dtype, and any
    other engine setting that changes K/V values, e.g.
    ``model_fingerprint("weights:3f2a...", "bfloat16", {"rope_theta": 10000.0})``.
    Equal parts give equal fingerprints in every process; the order of parts matters.
    """
    return hashlib.sha256(b"kvserve.model-fingerprint.v1" + canonical_bytes(parts)).hexdigest()


def request_extra_keys(
    model_fingerprint: str, adapter_id: str | None, cache_salt: str | None
) -> tuple[tuple[str, str], ...]:
    """The tagged extra keys of a request, in a fixed order.

    ``("model", fp)`` when the fingerprint is non-empty, ``("adapter", id)`` when an
    adapter is set, ``("cache_salt", salt)`` when a salt is set (None means no salt;
    an empty string is a salt of its own). Keys that are absent are left out.
    """
    keys: list[tuple[str, str]] = []
    if model_fingerprint:
        keys.append(("model", model_fingerprint))
    if adapter_id is not None:
        keys.append(("adapter", adapter_id))
    if cache_salt is not None:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys)


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple = (),
    algo: HashAlgo = "sha256",
) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block).

    Callers must keep these rules: ``token_ids`` are exactly one full block; pass the
    request's extra keys for the first block only (later blocks get them through
    ``parent``); token ids are integers in [-2**63, 2**63).

    ``algo="sha256"`` (default) is stable across processes; ``algo="builtin"`` is not.
    """
    if algo == "sha256":
        h = hashlib.sha256(_ROOT if parent is None else parent)
        h.update(_EMPTY_KEYS if not extra_keys else canonical_bytes(extra_keys))
        n = len(token_ids)
        h.update(_token_packer(n).pack(n, *token_ids))
        return BlockHash(h.digest())
    if algo == "builtin":
        value = hash((parent, tuple(token_ids), extra_keys))
        return BlockHash(value.to_bytes(8, "little", signed=True))
    raise ValueError(
        f"unknown hash_algo={algo!r}: must be one of {HASH_ALGOS} (for example: hash_algo='sha256')"
    )


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple,
    algo: HashAlgo = "sha256",
) -> list[BlockHash]:
    """Append to ``hashes`` the chained hash of every full block of ``token_ids`` that
    it does not cover yet, and return it (the same list).

    The one place the chain is walked: the KV cache manager calls it for its
    requests, and the scale-out ingress (``kvserve.cluster``) calls it to compute the
    very same hashes before routing. Callers must keep these rules: ``hashes`` holds
    the hashes of the first ``len(hashes)`` blocks of ``token_ids`` (or is empty);
    ``extra_keys`` are the request's (:func:`request_extra_keys`), used for block 0.
    """
    num_full = len(token_ids) // block_size
    i = len(hashes)
    parent: BlockHash | None = hashes[-1] if hashes else None
    while i < num_full:
        extra = extra_keys if i == 0 else ()
        parent = hash_block_tokens(
            parent, token_ids[i * block_size : (i + 1) * block_size], extra, algo
        )
        hashes.append(parent)
        i += 1
    return hashes
