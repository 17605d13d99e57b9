"""Disaggregated startup race (issue 21 item 10): a decode worker is not ready —
``/health`` 503 — until a prefill peer has answered a ping, so a long prompt sent as
soon as both report healthy is prefilled remotely, not locally."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from support.fake_runner import fake_engine
from support.server_helpers import serve_thread

from kvserve.engine.async_engine import AsyncEngine
from kvserve.entrypoints.openai_server import build_app
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.decode_connector import DecodeConnector
from kvserve.kv_transfer.transport import in_process_pair
from kvserve.kv_transfer.wire import Message, Ping, Pong
from kvserve.request import Request, SamplingParams


def _request() -> Request:
    from kvserve.kv_cache import KVCacheManager

    request = Request("long", list(range(1, 200)), SamplingParams(max_tokens=1))
    KVCacheManager(64, 4, 512).block_hashes(request)
    return request


def test_not_ready_until_the_peer_answers_then_prefills_remotely() -> None:
    dec_end, pre_end = in_process_pair("decode", "prefill")
    answering = {"on": False}

    def peer(sender: str, msg: Message) -> None:
        if answering["on"] and isinstance(msg, Ping):
            pre_end.send(sender, Pong(msg.seq, 0))

    pre_end.set_receiver(peer)
    cfg = KVTransferConfig(kv_role="decode", kv_prefill_peers=("prefill",), kv_remote_min_tokens=16)
    decode = DecodeConnector(cfg, dec_end, block_size=4, kv_dtype="float32")  # pings
    try:
        time.sleep(0.3)  # pings went out unanswered (the peer is still starting)
        assert not decode.is_ready
        answering["on"] = True
        deadline = time.monotonic() + 10
        while not decode.is_ready and time.monotonic() < deadline:
            time.sleep(0.02)
        assert decode.is_ready
        # Ready means the peer is usable: a long prompt goes to it, not local prefill.
        assert decode.get_num_new_matched_tokens(_request(), 0) > 0
        answering["on"] = False  # lost later: still ready (the failure policy decides)
        assert decode.is_ready
    finally:
        decode.close()
        pre_end.close()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvserve.model.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def test_health_is_503_while_the_connector_is_not_ready(tokenizer: Any) -> None:
    core, _ = fake_engine(tokenizer)
    engine = AsyncEngine(core)
    core.kv_connector = SimpleNamespace(is_ready=False, close=lambda: None)
    with serve_thread(build_app(engine)) as url:
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and "prefill peer" in r.json()["error"]["message"]
        core.kv_connector.is_ready = True
        assert httpx.get(url + "/health").status_code == 200
        core.kv_connector = None


def test_requests_waiting_for_remote_kv_count_as_waiting(tokenizer: Any) -> None:
    core, _ = fake_engine(tokenizer)
    parked = core.make_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="parked")
    core.scheduler.waiting_for_remote[parked.req_id] = parked  # as _admit parks it
    stats = core.stats()
    assert stats.num_requests_waiting == 1 and stats.num_requests_waiting_for_remote_kv == 1
    assert stats.num_requests_running == 0
    del core.scheduler.waiting_for_remote[parked.req_id]
    assert core.stats().num_requests_waiting == 0
