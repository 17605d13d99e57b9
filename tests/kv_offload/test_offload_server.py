"""A restarted ``kvserve serve`` process answers a prompt it computed before from the
disk tier: same completion, counted in /metrics."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
from support.server_helpers import scrape, serve_process

NUM_TOKENS = 300


def _complete(base_url: str, prompt: list[int]) -> list[str]:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [c["text"] for c in r.json()["choices"]]


def test_restarted_server_hits_the_disk_tier(tmp_path: Path) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(100, 20000) for _ in range(NUM_TOKENS)]
    args = [
        "--kv-offload-dir",
        str(tmp_path / "kv"),
        "--kv-offload-gib",
        "1",
        "--num-kv-blocks",
        "128",
        "--max-model-len",
        "1024",
        "--no-access-log",
    ]
    with serve_process(args, tmp_path, timeout_s=600.0) as server:
        first = _complete(server.base_url, prompt)
        before = scrape(server.base_url)
        assert before["kvserve:kv_offload_hits_total"] == 0
    # the SIGTERM shutdown finished the queued writes: the prompt's full blocks and the
    # one its output completed (the last sampled token has no KV)
    num_files = (NUM_TOKENS + 6 - 1) // 16
    assert len(list((tmp_path / "kv").rglob("*.kvb"))) == num_files
    with serve_process(args, tmp_path, timeout_s=600.0) as server:
        assert scrape(server.base_url)["kvserve:kv_offload_files"] == num_files
        assert _complete(server.base_url, prompt) == first
        after = scrape(server.base_url)
    num_hit = (NUM_TOKENS - 1) // 16
    assert after["kvserve:kv_offload_hits_total"] == num_hit
    assert after["kvserve:prefix_cache_hits_total"] == num_hit * 16
    assert after["kvserve:kv_offload_bytes_read_total"] > 0
    assert after["kvserve:kv_offload_read_seconds_total"] > 0
    assert after["kvserve:kv_offload_errors_total"] == 0
