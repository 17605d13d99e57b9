"""``--gpu-memory-utilization 0.9`` on a CPU host is a ceiling for the KV pool, not a
reservation (issue 43 item 5): after startup and one request the server's resident
memory stays under 2 GB (it was 21.5 GB), and the startup log says how much KV the
pool can hold and holds now."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from support.server_helpers import ServerProcess, serve_process

pytestmark = [pytest.mark.model, pytest.mark.slow]

RSS_LIMIT = 2 * 10**9


def rss_bytes(pid: int) -> int:
    """VmRSS of ``pid`` from /proc (bytes)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--gpu-memory-utilization", "0.9", "--no-access-log"]
    with serve_process(args, tmp_path_factory.mktemp("ceiling")) as s:
        yield s


def test_rss_after_startup_and_a_request_is_small(server: ServerProcess) -> None:
    after_start = rss_bytes(server.proc.pid)
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 32},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    after_request = rss_bytes(server.proc.pid)
    print(
        f"RSS after startup {after_start / 1e9:.2f} GB, after a request {after_request / 1e9:.2f} GB"
    )
    assert after_request < RSS_LIMIT
    log = server.log()
    m = re.search(
        r"KV cache pool: holds up to (\d+) tokens .* GiB ceiling, committed as used\); "
        r"resident now ([\d.]+) MiB",
        log,
    )
    assert m, log[-3000:]
    assert int(m.group(1)) > 100_000  # the ceiling is large...
    assert float(m.group(2)) < 1024  # ...and little of it is resident
