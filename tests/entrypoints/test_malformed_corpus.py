"""Replay the malformed-input corpus (``malformed_corpus.CASES``) against a server on
the fake runner: every answer a 4xx in OpenAI's error shape (0 x 5xx), and after
every probe 0 requests running, 0 waiting and 0 KV blocks active (the engine's own
counters after each probe, and ``/metrics`` at the end)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from malformed_corpus import CASES, Case
from support.fake_runner import fake_engine
from support.server_helpers import scrape, serve_thread

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine_core import EngineCore
from kvserve.entrypoints.openai_server import build_app

IDLE = ("num_requests_running", "num_requests_waiting", "num_active_blocks")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, EngineCore]]:
    from kvserve.model.loader import load_tokenizer

    core, _ = fake_engine(load_tokenizer("smollm2-135m-instruct"), max_model_len=256)
    with serve_thread(build_app(AsyncEngine(core), max_request_body_bytes=200_000)) as base:
        yield base, core
    core.check_no_leaks()


def _raw_status(url: str, head: bytes, body: bytes) -> int:
    """Send a request httpx would refuse to send (a lying Content-Length)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(head + body)
        reply = sock.recv(65536)
    return int(reply.split(b" ", 2)[1])


def _probe(client: httpx.Client, case: Case) -> str | None:
    name, method, path, headers, body = case
    if "Content-Length" in headers:
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n".encode()
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode() + b"\r\n"
        status = _raw_status(str(client.base_url), head, body)
        return None if 400 <= status < 500 else f"{name}: status {status}"
    try:
        r = client.request(method, path, content=body, headers=headers)
    except httpx.HTTPError as e:
        return f"{name}: transport error {e!r}"
    if not 400 <= r.status_code < 500:
        return f"{name}: status {r.status_code} {r.text[:200]}"
    try:
        err: Any = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{name}: {r.status_code} without an OpenAI error body: {r.text[:200]}"
    if set(err) != {"message", "type", "param", "code"} or not err["message"]:
        return f"{name}: malformed error {err}"
    return None


def test_malformed_corpus_is_all_4xx_and_leaves_the_engine_idle(
    served: tuple[str, EngineCore],
) -> None:
    url, core = served
    assert len(CASES) >= 200  # the corpus size reported in docs/security.md
    failures: list[str] = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for case in CASES:
            problem = _probe(client, case)
            if problem:
                failures.append(problem)
            stats = core.stats()  # the engine's own counters, after every probe
            busy = {k: getattr(stats, k) for k in IDLE if getattr(stats, k) != 0}
            if busy:
                failures.append(f"{case[0]}: engine not idle after the probe: {busy}")
        assert client.get("/health").status_code == 200
    metrics = scrape(url)
    assert all(metrics[f"kvserve:{k}"] == 0 for k in IDLE)
    assert not failures, "\n".join(failures[:40])
