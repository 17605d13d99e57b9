"""Graceful shutdown of a real ``kvserve serve`` process (issue 21 item 5): on SIGTERM
the port closes, in-flight requests drain for up to --graceful-shutdown-timeout, the
ones still running are cut with an OpenAI error event then ``data: [DONE]`` (streams)
or a JSON 503 (non-streamed), and the process exits as soon as nothing is in flight.
With nothing in flight at all it exits at once: the last test of
tests/entrypoints/test_server_lifecycle.py (on that module's server, so no second start here)."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import pytest
from support.server_helpers import serve_process

pytestmark = [pytest.mark.model, pytest.mark.slow]

ARGS = [
    "--max-num-seqs",
    "4",
    "--num-kv-blocks",
    "256",
    "--max-model-len",
    "2048",
    "--no-access-log",
    "--max-step-ms",
    "0",  # no step-time calibration at start: draining does not depend on it
]


def _stream(http: httpx.Client, url: str, max_tokens: int) -> httpx.Response:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True}
    req = http.build_request("POST", url + "/v1/completions", json={**body, "stream": True})
    return http.send(req, stream=True)


def test_sigterm_drains_then_cuts_cleanly(tmp_path: Any) -> None:
    with serve_process([*ARGS, "--graceful-shutdown-timeout", "4"], tmp_path) as server:
        url = server.base_url
        with httpx.Client(timeout=120) as http:
            short = _stream(http, url, 3)  # finishes within the grace period
            long = _stream(http, url, 1900)  # cannot: cut
            long_lines = long.iter_lines()
            next(line for line in long_lines if line.startswith("data: "))
            plain: dict[str, Any] = {}

            def non_streamed() -> None:
                body = {"prompt": "Hello", "max_tokens": 1900, "ignore_eos": True}
                r = httpx.post(url + "/v1/completions", json=body, timeout=120)
                plain.update(status=r.status_code, body=r.json(), headers=dict(r.headers))

            worker = threading.Thread(target=non_streamed)
            worker.start()
            time.sleep(1.0)  # the non-streamed request is running
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.TransportError):  # the port is closed at once
                httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            short_events = [line for line in short.iter_lines() if line.startswith("data: ")]
            assert short_events[-1] == "data: [DONE]"
            assert json.loads(short_events[-2][6:])["choices"][0]["finish_reason"] == "length"
            rest = [line for line in long_lines if line.startswith("data: ")]
            worker.join(timeout=60)
            code = server.proc.wait(timeout=60)
            elapsed = time.monotonic() - t0
    assert rest[-1] == "data: [DONE]", rest[-3:]
    err = json.loads(rest[-2][6:])["error"]
    assert err["code"] == "engine_unavailable" and "shut down" in err["message"]
    assert plain["status"] == 503, plain
    assert plain["body"]["error"]["code"] == "engine_unavailable"
    assert int(plain["headers"]["retry-after"]) >= 1
    assert code == 0, server.log()[-3000:]
    assert 3.5 < elapsed < 19, elapsed  # waited the grace period for the long ones, no more
    assert "Application shutdown complete" in server.log()
    with pytest.raises(httpx.ConnectError):  # the process is gone
        httpx.get(url + "/health")
