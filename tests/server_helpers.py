"""Helpers for the server tests: a free port, a real ``kvserve serve`` subprocess, an
in-process uvicorn thread, a small EngineCore double, and /metrics parsing."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.engine_core import EngineCore
from kvserve.engine.outputs import RequestDelta
from kvserve.request import SamplingParams
from kvserve.sched.output import Logprobs

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base_url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy")
        try:
            if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server at {base_url} not healthy after {timeout_s} s")


@dataclass
class ServerProcess:
    """A ``kvserve serve`` subprocess on a free port."""

    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    startup_s: float
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@contextmanager
def serve_process(
    args: list[str], tmp_dir: Path, *, api_key: str | None = None, timeout_s: float = 240.0
) -> Iterator[ServerProcess]:
    """Start ``python -m kvserve.entrypoints.cli serve --port P *args``; stop it on exit."""
    port = free_port()
    log_path = tmp_dir / f"serve-{port}.log"
    env = dict(os.environ)
    env.pop("KVSERVE_API_KEY", None)
    if api_key:
        env["KVSERVE_API_KEY"] = api_key
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port), *args]
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path, 0.0, api_key)
    try:
        wait_healthy(server.base_url, proc, timeout_s)
        server.startup_s = time.monotonic() - t0
        yield server
    except BaseException:
        print(server.log()[-5000:], file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def serve_thread(app: Any) -> Iterator[str]:
    """Run an ASGI app on uvicorn in a thread; yields the base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def scrape(base_url: str) -> dict[str, float]:
    """GET /metrics, parsed by prometheus-client's parser: sample name -> value
    (labels other than model_name are appended as ``name{k=v}``)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = {k: v for k, v in sample.labels.items() if k != "model_name"}
            key = sample.name
            if extra:
                key += "{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}"
            out[key] = sample.value
    return out


def wait_for_metric(base_url: str, name: str, value: float, timeout_s: float = 30.0) -> float:
    """Poll /metrics until ``name`` equals ``value``; return the last value seen."""
    deadline = time.monotonic() + timeout_s
    last = math.nan
    while time.monotonic() < deadline:
        last = scrape(base_url).get(name, math.nan)
        if last == value:
            return last
        time.sleep(0.05)
    return last


# --------------------------------------------------------------------- engine double
POISON_TOKEN = 13  # a prompt containing this token id makes the fake engine's step fail


@dataclass
class _FakeReq:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    out: list[int] = field(default_factory=list)


class FakeEngineCore:
    """A stand-in for :class:`EngineCore` with the same surface the server uses.

    Each step emits one token per running request (at most ``max_num_seqs`` run,
    the rest wait); token k of a request is ``(last prompt token + k + 1) % 200 +
    100``. Each request holds ``ceil(tokens / 16)`` "blocks". A prompt containing
    ``POISON_TOKEN`` makes ``step`` raise, as a broken model would.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int = 256,
        max_num_seqs: int = 8,
        step_s: float = 0.002,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = [2]
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.reqs: dict[str, _FakeReq] = {}
        self.order: list[str] = []
        self.num_steps = 0
        self.num_failed_steps = 0
        self.gate = threading.Event()  # cleared: step() blocks (to hold requests waiting)
        self.gate.set()

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        EngineCore.validate_request(self, prompt_token_ids, params)  # type: ignore[arg-type]

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        self.validate_request(prompt_token_ids, params)
        assert request_id is not None and request_id not in self.reqs
        if params.max_tokens is None:
            import dataclasses

            params = dataclasses.replace(
                params, max_tokens=self.max_model_len - len(prompt_token_ids)
            )
        self.reqs[request_id] = _FakeReq(request_id, list(prompt_token_ids), params, cache_salt)
        self.order.append(request_id)
        return request_id

    def abort_requests(self, req_ids: list[str] | str) -> None:
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        for r in req_ids:
            if r in self.reqs:
                del self.reqs[r]
                self.order.remove(r)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def running(self) -> list[str]:
        return self.order[: self.max_num_seqs]

    def step(self) -> list[RequestDelta]:
        self.gate.wait()
        time.sleep(self.step_s)
        self.num_steps += 1
        running = self.running()
        if any(POISON_TOKEN in self.reqs[r].prompt for r in running):
            raise RuntimeError("fake model failure")
        deltas = []
        for r in running:
            req = self.reqs[r]
            tok = (req.prompt[-1] + len(req.out) + 1) % 200 + 100
            req.out.append(tok)
            lps = []
            if req.params.logprobs is not None:
                n = req.params.logprobs
                lps = [Logprobs(-0.5, [tok, tok + 1, tok + 2][:n], [-0.5, -1.5, -2.5][:n])]
            finished = len(req.out) >= (req.params.max_tokens or 16)
            deltas.append(
                RequestDelta(
                    request_id=r,
                    new_token_ids=[tok],
                    new_text=self.tokenizer.decode([tok]),
                    new_logprobs=lps,
                    finish_reason="length" if finished else None,
                    num_prompt_tokens=len(req.prompt),
                    num_cached_tokens=0,
                    num_output_tokens=len(req.out),
                )
            )
            if finished:
                self.abort_requests(r)
        return deltas

    def stats(self) -> dict[str, Any]:
        running = self.running()
        active = sum(-(-(len(q.prompt) + len(q.out)) // 16) for q in self.reqs.values())
        return {
            "num_requests_running": len(running),
            "num_requests_waiting": len(self.order) - len(running),
            "kv_cache_usage_perc": active / 1000,
            "num_active_blocks": active,
            "num_reclaimable_blocks": 0,
            "num_empty_blocks": 1000 - active,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "num_preemptions": 0,
            "total_padding_tokens": 0,
            "scheduler_state": "ACTIVE_DECODE" if running else "IDLE",
            "num_failed_steps": self.num_failed_steps,
        }
