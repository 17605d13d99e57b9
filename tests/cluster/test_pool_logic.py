"""Prefill/decode pools without a cluster: how a decode replica picks a prefill
replica (prefix and load), and how its connector follows a changing prefill pool over
real ZeroMQ sockets (a peer added is used once it answers, a peer dropped fails its
loads at once, recompute)."""

from __future__ import annotations

import time
from typing import Any

from support.kv_connector import hashed_request

from kvserve.cluster.policy import ReplicaReport
from kvserve.cluster.pool_peers import PrefillChooser, PrefillPeer, parse_peers
from kvserve.cluster.prefix_index import block_key, pack_keys
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.decode_connector import DecodeConnector
from kvserve.kv_transfer.tcp import DealerTransport, RouterTransport
from kvserve.kv_transfer.wire import Message, Ping, Pong, PrefillRequest

B = 4


def _report(seq: int, keys: list[bytes], running: int = 0) -> ReplicaReport:
    return ReplicaReport("e", seq, running, 0, 100, 100, pack_keys(keys))


def test_the_chooser_follows_the_prefix_then_the_load() -> None:
    tokens = list(range(100, 100 + 8 * B + 1))
    request = hashed_request("r1", tokens, 64, B)
    keys = [block_key(h) for h in request.block_hashes]
    chooser = PrefillChooser()
    addresses = chooser.update(
        [
            PrefillPeer("pa", "127.0.0.1:1", _report(1, [])),
            PrefillPeer("pb", "127.0.0.1:2", _report(1, keys)),  # holds the whole prompt
        ]
    )
    assert addresses == ["127.0.0.1:1", "127.0.0.1:2"]
    assert chooser.choose(request, addresses) == "127.0.0.1:2"
    assert chooser.logic.in_flight("pb") == 1
    chooser.finished("r1")
    assert chooser.logic.in_flight("pb") == 0
    # only pa alive: pa, whatever the prefix
    assert chooser.choose(hashed_request("r2", tokens, 64, B), ["127.0.0.1:1"]) == "127.0.0.1:1"
    chooser.finished("r2")
    # a new prompt goes to the less loaded one; pb is busy with 20 requests
    chooser.update(
        [
            PrefillPeer("pa", "127.0.0.1:1", _report(2, [])),
            PrefillPeer("pb", "127.0.0.1:2", _report(2, keys, running=20)),
        ]
    )
    other = hashed_request("r3", list(range(5000, 5000 + 8 * B + 1)), 64, B)
    assert chooser.choose(other, addresses) == "127.0.0.1:1"
    # and pb's prefix no longer outweighs its queue either (20 x 0.1 > 1)
    assert chooser.choose(hashed_request("r4", tokens, 64, B), addresses) == "127.0.0.1:1"
    # a replica the hub no longer lists is forgotten
    assert chooser.update([PrefillPeer("pa", "127.0.0.1:1", None)]) == ["127.0.0.1:1"]
    assert chooser.logic.known_replicas() <= {"pa"}


def test_parse_peers_keeps_listed_addresses() -> None:
    raw: dict[str, dict[str, Any]] = {
        "b": {"kv_address": "127.0.0.1:9", "report": _report(1, []).to_stats()},
        "a": {"kv_address": "127.0.0.1:8"},
        "c": {"report": None},  # no address yet: not a peer
    }
    peers = parse_peers(raw)
    assert [(p.replica, p.kv_address) for p in peers] == [
        ("a", "127.0.0.1:8"),
        ("b", "127.0.0.1:9"),
    ]
    assert peers[0].report is None and peers[1].report is not None


def _until(cond, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_decode_connector_follows_a_changing_prefill_pool() -> None:
    prefill = RouterTransport("127.0.0.1", 0)
    host, port = prefill.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    asked: list[Message] = []

    def answer(peer: str, msg: Message) -> None:
        if isinstance(msg, Ping):
            prefill.send(peer, Pong(msg.seq, 0))
        else:
            asked.append(msg)

    prefill.set_receiver(answer)
    config = KVTransferConfig(
        kv_role="decode", kv_remote_min_tokens=1, kv_load_failure_policy="recompute"
    )
    transport = DealerTransport([])
    chooser = PrefillChooser()
    decode = DecodeConnector(
        config, transport, block_size=B, kv_dtype="float32", peer_chooser=chooser
    )
    try:
        assert not decode.is_ready  # no peer yet
        request = hashed_request("r", list(range(10, 10 + 6 * B + 1)), 64, B)
        assert decode.get_num_new_matched_tokens(request, 0) == 0  # none alive: local
        decode.set_peers(chooser.update([PrefillPeer("p0", prefill.address, None)]))
        assert _until(lambda: decode.is_ready), "the new peer never answered a ping"
        assert transport.peers == [prefill.address]
        n = decode.get_num_new_matched_tokens(request, 0)
        assert n == 6 * B
        decode.update_state_after_alloc(request, list(range(1, 8)), n)
        assert _until(lambda: bool(asked))
        (ask,) = asked
        assert isinstance(ask, PrefillRequest) and ask.req_id == "r" and ask.num_blocks == 6
        assert chooser.logic.in_flight("p0") == 1
        # the pool loses its prefill replica: the load fails at once, to be recomputed
        decode.set_peers(chooser.update([]))
        (result,) = decode.get_finished_loads()
        assert result.req_id == "r" and result.num_tokens_ok == 0
        assert result.error is not None and not result.fatal
        assert not decode._remote  # nothing left in flight
        assert _until(lambda: transport.peers == [])
    finally:
        decode.close()
        prefill.close()
