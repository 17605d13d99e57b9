"""Disaggregated serving with real processes on localhost (one torch thread each):
a prefill worker, a decode worker that uses it (policy recompute), and a decode
worker with policy fail whose only peer is a fake in this process.

All run in float32 so greedy outputs can be compared with the single-process engine
exactly (in bfloat16, a prompt computed in different chunk shapes - which a prefix
hit in one process does too - may already flip a near-tied greedy token).
The workers start once for the module; the test that kills the prefill worker is last.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.kv_peers import FakeDecodeWorker, FakePrefillPeer
from support.server_helpers import REPO, free_port, scrape, wait_healthy

from kvserve.kv_transfer.wire import Chunk, Done, Ping, PrefillRequest

pytestmark = pytest.mark.timeout(600)

BLOCK = 16
MAX_TOKENS = 8
COMMON = [
    "--dtype",
    "float32",
    "--quantization",
    "none",  # the reference engine runs the float weights (loaded_model)
    "--max-num-batched-tokens",
    "512",  # long prompts prefill in several chunks, so there is time to cut them
    "--max-model-len",
    "2048",
    "--num-kv-blocks",
    "400",
    "--no-access-log",
    "--max-step-ms",
    "0",  # token budgets only: no step-time calibration at each start (the default-
    # config disaggregated run, calibration included, is tests/determinism/test_default_reach.py)
]


class Proc:
    def __init__(self, name: str, args: list[str], tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{name}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env.pop("KVSERVE_API_KEY", None)
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*cmd, *COMMON, *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def metric(self, name: str) -> float:
        return scrape(self.url).get(name, 0.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.kv_port = free_port()
        self.fake_port = free_port()
        self.fake = FakePrefillPeer(self.fake_port)
        self.prefill = Proc(
            "prefill",
            ["--kv-role", "prefill", "--kv-address", f"127.0.0.1:{self.kv_port}",
             "--kv-transfer-timeout", "2"],
            tmp,
        )  # fmt: skip
        self.decode = Proc(
            "decode",
            ["--kv-role", "decode", "--kv-prefill-peers", f"127.0.0.1:{self.kv_port}",
             "--kv-remote-min-tokens", "32", "--kv-transfer-timeout", "3"],
            tmp,
        )  # fmt: skip
        self.decode_fail = Proc(
            "decode-fail",
            ["--kv-role", "decode", "--kv-prefill-peers", f"127.0.0.1:{self.fake_port}",
             "--kv-remote-min-tokens", "32", "--kv-transfer-timeout", "2",
             "--kv-load-failure-policy", "fail"],
            tmp,
        )  # fmt: skip
        self.procs = [self.prefill, self.decode, self.decode_fail]

    def close(self) -> None:
        for p in self.procs:
            p.stop()
        self.fake.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("disagg"))
    try:
        for p in c.procs:
            wait_healthy(p.url, p.proc, 300)
        yield c
    except BaseException:
        for p in c.procs:
            print(p.log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        c.close()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


PROMPTS = {
    "short": _prompt(1, 120),
    "long": _prompt(2, 1600),  # 100 blocks: four 512-token chunks on the prefill worker
    "killed": _prompt(4, 1500),
}
PROMPTS["prefix"] = PROMPTS["long"][:800] + _prompt(3, 200)  # 50 blocks hit locally


@pytest.fixture(scope="module")
def reference(loaded_model, single_thread_torch) -> dict[str, str]:
    """Greedy texts of the single-process engine (float32, same limits)."""
    from kvserve.engine.args import build_engine_config
    from kvserve.engine.engine_core import EngineCore
    from kvserve.request import SamplingParams

    config = build_engine_config(
        dtype="float32", max_model_len=2048, num_kv_blocks=400, max_step_ms=0
    )
    engine = EngineCore(config, loaded=loaded_model)
    out: dict[str, str] = {}
    for name in ("short", "long", "prefix", "killed"):
        req_id = engine.add_request(
            PROMPTS[name], SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        )
        text, done = "", False
        while not done:
            for delta in engine.step():
                if delta.request_id == req_id:
                    text += delta.new_text
                    done = delta.finished
        out[name] = text
    return out


def _complete(url: str, prompt: list[int], timeout: float = 120.0) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def _sources(p: Proc) -> dict[str, float]:
    m = scrape(p.url)
    return {
        s: m.get(f"kvserve:prompt_tokens_by_source_total{{source={s}}}", 0.0)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


def _wait_metric(p: Proc, name: str, pred, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = p.metric(name)
        if pred(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


ACTIVE = "kvserve:num_active_blocks"


def test_greedy_parity_short_long_and_prefix_hit(cluster, reference):
    decode = cluster.decode
    for name in ("short", "long", "prefix"):
        before = _sources(decode)
        r = _complete(decode.url, PROMPTS[name])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference[name], name
        after = _sources(decode)
        delta = {k: after[k] - before[k] for k in after}
        n = len(PROMPTS[name])
        assert sum(delta.values()) == n
        # Remote prefill: the decode worker computed at most one block of the prompt.
        assert delta["external_kv_transfer"] > 0 and delta["local_compute"] <= BLOCK, (name, delta)
        if name == "prefix":
            assert delta["local_cache_hit"] == 800  # its own prefix cache first
    assert decode.metric("kvserve:kv_transfer_blocks_total{direction=received}") >= (
        (120 - 1) // BLOCK + (1600 - 1) // BLOCK + (1000 - 1) // BLOCK - 50
    )
    sent = cluster.prefill.metric("kvserve:kv_transfer_bytes_total{direction=sent}")
    assert sent == decode.metric("kvserve:kv_transfer_bytes_total{direction=received}") > 0
    # Blocks back to baseline on both sides (the prefill side frees on the claim).
    assert _wait_metric(decode, ACTIVE, lambda v: v == 0) == 0
    assert _wait_metric(cluster.prefill, ACTIVE, lambda v: v == 0) == 0


def test_client_disconnect_cancels_the_remote_prefill(cluster):
    aborted = "kvserve:request_success_total{finished_reason=abort}"
    before = cluster.prefill.metric(aborted)
    body = {"prompt": _prompt(5, 1800), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    url = cluster.decode.url + "/v1/completions"
    with (
        httpx.Client(timeout=httpx.Timeout(10.0, read=0.8)) as client,
        pytest.raises(httpx.ReadTimeout),
        client.stream("POST", url, json=body) as r,
    ):
        for _ in r.iter_bytes():
            pass
    # The prefill worker aborted it (it had not finished) and both sides let go.
    assert _wait_metric(cluster.prefill, aborted, lambda v: v > before) == before + 1
    assert _wait_metric(cluster.decode, ACTIVE, lambda v: v == 0) == 0
    assert _wait_metric(cluster.prefill, ACTIVE, lambda v: v == 0) == 0
    assert cluster.prefill.metric("kvserve:num_requests_running") == 0


def test_prefill_worker_frees_unclaimed_blocks_after_the_lease(cluster):
    fake = FakeDecodeWorker(f"127.0.0.1:{cluster.kv_port}")
    try:
        deadline = time.monotonic() + 30
        while not any(m.kind == "pong" for m in fake.messages):
            assert time.monotonic() < deadline, "prefill worker never answered a ping"
            fake.send(Ping(1))
            time.sleep(0.1)
        prompt = _prompt(6, 200)
        fake.send(PrefillRequest("lease", prompt, 0, 12))
        fake.send(PrefillRequest("lease", prompt, 0, 12))  # a duplicate: ignored
        fake.send(PrefillRequest("bad", prompt, 10, 5))  # outside the prompt: refused
        done = fake.wait_for("done")
        assert isinstance(done, Done) and done.num_blocks == 12
        err = fake.wait_for("error")
        assert err.req_id == "bad" and "inside" in err.message
        chunks = [m for m in fake.messages if isinstance(m, Chunk) and m.req_id == "lease"]
        assert sorted(i for c in chunks for i in c.block_indices) == list(range(12))
        assert cluster.prefill.metric(ACTIVE) > 0  # held for a claim that never comes
        # Lease = 2 x --kv-transfer-timeout 2 = 4 s.
        assert _wait_metric(cluster.prefill, ACTIVE, lambda v: v == 0, timeout_s=15) == 0
    finally:
        fake.close()


def test_fail_policy_slow_unreachable_and_returning_peer(cluster):
    dec, fake = cluster.decode_fail, cluster.fake
    prompt = _prompt(7, 100)
    # Slower than --kv-transfer-timeout (the peer never sends): 503, nothing stranded.
    t0 = time.monotonic()
    r = _complete(dec.url, prompt)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_transfer_failed" and "sent nothing" in err["message"]
    assert 1.5 < time.monotonic() - t0 < 30
    assert len(fake.requests) == 1 and fake.requests[0].num_blocks == (100 - 1) // BLOCK
    assert _wait_metric(dec, ACTIVE, lambda v: v == 0) == 0
    # Unreachable: no answer to pings -> 503 at once.
    fake.alive = False
    time.sleep(2.5)
    r = _complete(dec.url, prompt)
    assert r.status_code == 503 and "reachable" in r.json()["error"]["message"]
    assert len(fake.requests) == 1
    # The peer comes back: it is used again (here it refuses, so still 503).
    fake.alive, fake.refuse = True, True
    time.sleep(1.0)
    r = _complete(dec.url, prompt)
    assert r.status_code == 503 and "refused by the test" in r.json()["error"]["message"]
    assert len(fake.requests) == 2
    # A short prompt never goes remote: served locally even with fail policy.
    assert _complete(dec.url, prompt[:20]).status_code == 200
    assert dec.metric("kvserve:kv_transfer_failures_total") == 3
    assert _wait_metric(dec, ACTIVE, lambda v: v == 0) == 0


def test_prefill_killed_mid_stream_recomputes_locally(cluster, reference):
    """Last: it kills the prefill worker."""
    decode, prefill = cluster.decode, cluster.prefill
    sent_before = prefill.metric("kvserve:kv_transfer_blocks_total{direction=sent}")
    failures_before = decode.metric("kvserve:kv_transfer_failures_total")
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: result.update(r=_complete(decode.url, PROMPTS["killed"])))
    t.start()
    # Kill it once its first chunk went out (mid-stream: 1500 tokens take 3 chunks).
    _wait_metric(
        prefill, "kvserve:kv_transfer_blocks_total{direction=sent}", lambda v: v > sent_before, 60
    )
    prefill.proc.send_signal(signal.SIGKILL)
    prefill.proc.wait()
    t.join(120)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference["killed"]
    assert decode.metric("kvserve:kv_transfer_failures_total") == failures_before + 1
    assert _wait_metric(decode, ACTIVE, lambda v: v == 0) == 0
    # With the peer gone, long prompts are prefilled locally (recompute policy).
    before = _sources(decode)
    r = _complete(decode.url, _prompt(8, 300))
    assert r.status_code == 200
    assert _sources(decode)["local_compute"] - before["local_compute"] == 300
