"""Queue limit and graceful SIGTERM on a small real server (one running request at a time).

The server runs with ``--max-num-seqs 1 --max-queue-len 1``: one request runs, one may
wait, a third gets 429 + Retry-After. The SIGTERM test runs last on the same process:
with nothing in flight the process exits at once, well inside its 30 s grace period
(cutting in-flight requests after the grace period is tests/entrypoints/test_server_shutdown.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from support.server_helpers import API_KEYS, ServerProcess, scrape, serve_process

pytestmark = [pytest.mark.model, pytest.mark.slow]

KEY = "flag-key"


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [
        "--max-num-seqs", "1",
        "--max-queue-len", "1",
        "--num-kv-blocks", "128",
        "--max-model-len", "1024",
        "--api-key", KEY,
        "--graceful-shutdown-timeout", "30",
        "--no-access-log",
        "--max-step-ms", "0",  # no step-time calibration at start
    ]  # fmt: skip
    with serve_process(args, tmp_path_factory.mktemp("small")) as server:
        server.api_key = KEY
        API_KEYS[server.base_url] = KEY  # scrape() sends it: /metrics needs the key
        print(f"small server startup: {server.startup_s:.1f} s")
        yield server


def _open_stream(http: httpx.Client, server: ServerProcess, max_tokens: int) -> httpx.Response:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    request = http.build_request(
        "POST", server.base_url + "/v1/completions", json=body, headers=server.headers
    )
    return http.send(request, stream=True)


def _read_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_queue_limit_429_with_retry_after(small_server: ServerProcess) -> None:
    url = small_server.base_url
    with httpx.Client(timeout=120) as http:
        running = _open_stream(http, small_server, 600)  # long: still running below
        running_lines = running.iter_lines()
        first = next(line for line in running_lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        waiting = _open_stream(http, small_server, 4)  # queued behind it
        assert waiting.status_code == 200
        assert scrape(url)["kvserve:num_requests_waiting"] == 1

        refused = http.post(
            url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 2},
            headers=small_server.headers,
        )
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        err = refused.json()["error"]
        assert err["code"] == "queue_full" and "retry" in err["message"]
        assert scrape(url)["kvserve:num_requests_rejected_total"] == 1

        # nothing else disturbed: the running request keeps streaming; once it is gone
        # the waiting one runs to completion
        assert sum(1 for _ in zip(range(3), running_lines, strict=False)) == 3
        running.close()
        events = _read_events(waiting)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        ok = http.post(
            url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 2},
            headers=small_server.headers,
        )
        assert ok.status_code == 200
    assert scrape(url)["kvserve:num_active_blocks"] == 0


def test_sigterm_with_nothing_in_flight_exits_at_once(small_server: ServerProcess) -> None:
    """Last: it stops the server. Nothing in flight: no wait for the grace period."""
    r = httpx.post(
        small_server.base_url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 3},
        headers=small_server.headers,
        timeout=120,
    )
    assert r.status_code == 200
    t0 = time.monotonic()
    small_server.proc.send_signal(signal.SIGTERM)
    try:
        code = small_server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        small_server.proc.kill()
        raise
    elapsed = time.monotonic() - t0
    assert code == 0 and elapsed < 5, (code, elapsed, small_server.log()[-3000:])
    assert "Application shutdown complete" in small_server.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(small_server.base_url + "/health")
