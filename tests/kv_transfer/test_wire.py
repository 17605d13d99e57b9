"""The wire format: round trips, and everything malformed is refused (never unpickled)."""

from __future__ import annotations

import json

import pytest

from kvserve.kv_transfer.wire import (
    Cancel,
    Chunk,
    Claim,
    Done,
    Error,
    Ping,
    Pong,
    PrefillRequest,
    WireError,
    decode_message,
    encode_message,
)


def _chunk(**kw):
    base = dict(
        req_id="r",
        block_indices=[3, 4],
        block_hashes=["aa", "bb"],
        dtype="bfloat16",
        shape=[1, 2, 1, 2, 2, 2],
        saved_time=1.5,
        payload=bytes(range(32)),
    )
    return Chunk(**(base | kw))


@pytest.mark.parametrize(
    "msg",
    [
        PrefillRequest("r", [1, 2, 3], 0, 1, cache_salt=None),
        PrefillRequest("r", [1, 2, 3], 0, 1, cache_salt="tenant"),
        Cancel("r"),
        Claim("r"),
        Ping(7),
        Pong(7, 3),
        Done("r", 4, 42, 12.5),
        Error("r", "too long"),
    ],
)
def test_round_trip(msg):
    frames = encode_message(msg)
    assert len(frames) == 1 and json.loads(frames[0])["kind"] == msg.kind
    assert decode_message([bytes(f) for f in frames]) == msg


def test_chunk_round_trip_keeps_payload_bytes():
    msg = _chunk()
    frames = encode_message(msg)
    assert len(frames) == 2 and bytes(frames[1]) == msg.payload
    back = decode_message([bytes(f) for f in frames])
    assert isinstance(back, Chunk) and bytes(back.payload) == msg.payload
    assert back.block_indices == [3, 4] and back.shape == [1, 2, 1, 2, 2, 2]


@pytest.mark.parametrize(
    "frames, match",
    [
        ([], "frames"),
        ([b"\x80\x04\x95pickle"], "not JSON"),
        ([b"[]"], "version"),
        ([b'{"v": 2, "kind": "ping", "seq": 1}'], "version"),
        ([b'{"v": 1, "kind": "exec", "seq": 1}'], "unknown message kind"),
        ([b'{"v": 1, "kind": "ping"}'], "missing field"),
        ([b'{"v": 1, "kind": "ping", "seq": "1"}'], "wrong type"),
        ([b'{"v": 1, "kind": "ping", "seq": true}'], "wrong type"),
        ([b'{"v": 1, "kind": "ping", "seq": 1}', b"x"], "unexpected payload"),
        (
            [
                b'{"v":1,"kind":"prefill","req_id":"r","prompt_token_ids":[1,-2],'
                b'"first_block":0,"num_blocks":1,"cache_salt":null}'
            ],
            "integers >= 0",
        ),
    ],
)
def test_malformed_messages_are_refused(frames, match):
    with pytest.raises(WireError, match=match):
        decode_message(frames)


def test_chunk_payload_must_match_shape_and_indices():
    frames = encode_message(_chunk())
    with pytest.raises(WireError, match="payload of 31 bytes"):
        decode_message([frames[0], bytes(31)])
    with pytest.raises(WireError, match="missing payload"):
        decode_message([frames[0]])
    bad = encode_message(_chunk(block_indices=[3, 3]))
    with pytest.raises(WireError, match="repeated block index"):
        decode_message(bad)
    bad = encode_message(_chunk(shape=[1, 2, 1, 3, 2, 2], payload=bytes(48)))
    with pytest.raises(WireError, match="matching the indices"):
        decode_message(bad)
    bad = encode_message(_chunk(dtype="int4"))  # int8 / fp8_e4m3 are KV formats now
    with pytest.raises(WireError, match="dtype"):
        decode_message(bad)
