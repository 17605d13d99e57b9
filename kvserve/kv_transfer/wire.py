"""The wire format between decode and prefill workers: a small JSON header, then raw
tensor bytes. Nothing from the network is ever unpickled.

Every message is one or two frames::

    frame 0: UTF-8 JSON object, at most MAX_HEADER_BYTES, {"v": 1, "kind": ..., ...}
    frame 1: only for "chunk": the KV of ``len(block_indices)`` blocks as raw bytes,
             shape [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]
             in ``dtype`` (the layout of the paged cache, blocks gathered)

Kinds (decode -> prefill): ``prefill`` (compute this prompt, push blocks
``[first_block, first_block + num_blocks)``), ``cancel``, ``claim`` (every block
arrived and was checked: free them), ``ping``.
Kinds (prefill -> decode): ``chunk`` (blocks by index, with their hashes), ``done``
(all blocks were pushed; the first sampled token), ``error``, ``pong`` (load).

:func:`decode_message` raises :class:`WireError` on anything malformed; receivers
drop such messages (and count them) instead of failing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

WIRE_VERSION = 1
MAX_HEADER_BYTES = 1 << 22  # a 32k-token prompt as JSON fits comfortably
# KV cache formats a chunk may carry (int8 / fp8_e4m3: 8-bit codes and per-row fp32
# scales, one byte per element of a [.., D + 4] row; kvserve.model.kernels.kv8)
DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3")
_ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8_e4m3": 1}


class WireError(ValueError):
    """A message that does not follow the wire format."""


@dataclass
class PrefillRequest:
    """Decode -> prefill: compute ``prompt_token_ids`` and push the KV of blocks
    ``[first_block, first_block + num_blocks)`` (full blocks only). ``kv_dtype``: the
    decode worker's KV cache format; a prefill worker storing another refuses."""

    req_id: str
    prompt_token_ids: list[int]
    first_block: int
    num_blocks: int
    cache_salt: str | None = None
    kv_dtype: str | None = None
    kind: str = field(default="prefill", init=False)


@dataclass
class Cancel:
    req_id: str
    kind: str = field(default="cancel", init=False)


@dataclass
class Claim:
    req_id: str
    kind: str = field(default="claim", init=False)


@dataclass
class Ping:
    seq: int
    kind: str = field(default="ping", init=False)


@dataclass
class Pong:
    seq: int
    load: int  # prefill requests the worker holds (queued, running or unclaimed)
    kind: str = field(default="pong", init=False)


@dataclass
class Chunk:
    """Prefill -> decode: the KV of some blocks of one request. ``block_indices`` are
    positions in the request's block table (block ``i`` holds tokens ``[i*B,(i+1)*B)``);
    ``block_hashes`` are their chained hashes, hex. ``payload`` is frame 1."""

    req_id: str
    block_indices: list[int]
    block_hashes: list[str]
    dtype: str
    shape: list[int]
    saved_time: float  # wall time the step that completed these blocks ended
    payload: bytes | memoryview = b""
    kind: str = field(default="chunk", init=False)


@dataclass
class Done:
    """Prefill -> decode: every requested block was pushed (``num_blocks`` of them)."""

    req_id: str
    num_blocks: int
    first_token_id: int
    compute_end_time: float  # wall time the prompt's last step ended
    kind: str = field(default="done", init=False)


@dataclass
class Error:
    req_id: str
    message: str
    kind: str = field(default="error", init=False)


Message = PrefillRequest | Cancel | Claim | Ping | Pong | Chunk | Done | Error

_TYPES: dict[str, type] = {
    "prefill": PrefillRequest,
    "cancel": Cancel,
    "claim": Claim,
    "ping": Ping,
    "pong": Pong,
    "chunk": Chunk,
    "done": Done,
    "error": Error,
}
# field -> (accepted types) per kind; every field is required but those in _OPTIONAL
# (absent: the dataclass default, e.g. a peer that does not send the KV dtype).
_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "prefill": {
        "req_id": (str,),
        "prompt_token_ids": (list,),
        "first_block": (int,),
        "num_blocks": (int,),
        "cache_salt": (str, type(None)),
        "kv_dtype": (str, type(None)),
    },
    "cancel": {"req_id": (str,)},
    "claim": {"req_id": (str,)},
    "ping": {"seq": (int,)},
    "pong": {"seq": (int,), "load": (int,)},
    "chunk": {
        "req_id": (str,),
        "block_indices": (list,),
        "block_hashes": (list,),
        "dtype": (str,),
        "shape": (list,),
        "saved_time": (float, int),
    },
    "done": {
        "req_id": (str,),
        "num_blocks": (int,),
        "first_token_id": (int,),
        "compute_end_time": (float, int),
    },
    "error": {"req_id": (str,), "message": (str,)},
}
_OPTIONAL = {("prefill", "kv_dtype")}


def encode_message(msg: Message) -> list[bytes | memoryview]:
    """The frames of ``msg`` (the payload of a chunk is passed through, not copied)."""
    header: dict[str, Any] = {
        f.name: getattr(msg, f.name) for f in fields(msg) if f.name != "payload"
    }
    header["v"] = WIRE_VERSION
    frames: list[bytes | memoryview] = [json.dumps(header, separators=(",", ":")).encode()]
    if isinstance(msg, Chunk):
        frames.append(msg.payload)
    return frames


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def decode_message(frames: Sequence[bytes | memoryview]) -> Message:
    """Parse and check one message; raise :class:`WireError` when anything is off:
    wrong frame count, oversized or non-JSON header, unknown kind or version, a
    missing or mistyped field, a chunk whose payload size does not match its shape."""
    if not frames or len(frames) > 2:
        raise WireError(f"expected 1 or 2 frames, got {len(frames)}")
    raw = bytes(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("v") != WIRE_VERSION:
        raise WireError(f"header is not a version-{WIRE_VERSION} object")
    kind = header.get("kind")
    if kind not in _TYPES:
        raise WireError(f"unknown message kind {kind!r}")
    spec = _FIELDS[kind]
    values: dict[str, Any] = {}
    for name, types in spec.items():
        if name not in header:
            if (kind, name) in _OPTIONAL:
                continue
            raise WireError(f"{kind}: missing field {name!r}")
        value = header[name]
        ok = any(
            (_is_int(value) if t is int else isinstance(value, t) and not isinstance(value, bool))
            for t in types
        ) or (value is None and type(None) in types)
        if not ok:
            raise WireError(f"{kind}: field {name!r} has the wrong type")
        values[name] = value
    for name in ("prompt_token_ids", "block_indices", "shape"):
        if name in values and not all(_is_int(x) and x >= 0 for x in values[name]):
            raise WireError(f"{kind}: {name} must hold integers >= 0")
    if kind == "chunk":
        return _decode_chunk(values, frames)
    if len(frames) != 1:
        raise WireError(f"{kind}: unexpected payload frame")
    return _TYPES[kind](**values)  # type: ignore[no-any-return]


def _decode_chunk(values: dict[str, Any], frames: Sequence[bytes | memoryview]) -> Chunk:
    if len(frames) != 2:
        raise WireError("chunk: missing payload frame")
    if values["dtype"] not in DTYPES:
        raise WireError(f"chunk: dtype must be one of {DTYPES}")
    if not all(isinstance(h, str) and len(h) <= 128 for h in values["block_hashes"]):
        raise WireError("chunk: block_hashes must be hex strings")
    shape = values["shape"]
    n = len(values["block_indices"])
    if len(shape) != 6 or shape[3] != n or n != len(values["block_hashes"]) or n == 0:
        raise WireError("chunk: shape must be [L, 2, Hk, num_blocks, B, D] matching the indices")
    if len(set(values["block_indices"])) != n:
        raise WireError("chunk: repeated block index")
    elem = _ELEM_BYTES[values["dtype"]]
    expected = elem
    for dim in shape:
        expected *= dim
    payload = frames[1]
    if memoryview(payload).nbytes != expected:
        raise WireError(
            f"chunk: payload of {memoryview(payload).nbytes} bytes, shape needs {expected}"
        )
    return Chunk(payload=payload, **values)
