"""Helpers for the server tests: a free port, a real ``kvserve serve`` subprocess, an
in-process uvicorn thread, and /metrics parsing. Imports only ``kvserve.bench``'s
process and metrics helpers (not the engine), so the conftest that uses it stays
importable whatever state the engine is in."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.bench.disagg import scrape_metrics
from kvserve.bench.process import free_port, stop_process, wait_healthy

REPO = Path(__file__).resolve().parents[2]


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


# the folders under kvserve's cache root (kvserve.model.model_files.cache_dir and the
# kernel build, packed weights, inductor and step-time stores)
CACHE_FOLDERS = ("ext", "fingerprints", "inductor", "models", "packed", "step_cost", "synthetic")


def cache_root_with_own(own: tuple[str, ...], tmp_dir: Path) -> Path:
    """A ``KVSERVE_CACHE_DIR`` for a server: ``tmp_dir/cache``, whose folders named in
    ``own`` start empty and every other cache folder links to the caller's cache (so a
    server that needs, say, its own step-time store does not convert the model, build
    the kernels and repack the weights again). Returns the new root."""
    shared = Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")
    root = tmp_dir / "cache"
    root.mkdir(parents=True, exist_ok=True)
    for name in CACHE_FOLDERS:
        if name in own:
            (root / name).mkdir(exist_ok=True)
        else:
            target = shared.expanduser() / name
            target.mkdir(parents=True, exist_ok=True)
            (root / name).symlink_to(target, target_is_directory=True)
    return root


@contextmanager
def serve_process(
    args: list[str],
    tmp_dir: Path,
    *,
    api_key: str | None = None,
    timeout_s: float = 240.0,
    env_overrides: dict[str, str] | None = None,
) -> Iterator[ServerProcess]:
    """Start ``python -m kvserve.entrypoints.cli serve --port P *args``; stop it on exit."""
    port = free_port()
    log_path = tmp_dir / f"serve-{port}.log"
    env = dict(os.environ) | (env_overrides or {})
    env.pop("KVSERVE_API_KEY", None)
    if api_key:
        env["KVSERVE_API_KEY"] = api_key
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port), *args]
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path, 0.0, api_key)
    if api_key:
        API_KEYS[server.base_url] = api_key
    try:
        wait_healthy(server.base_url, proc, timeout_s)
        server.startup_s = time.monotonic() - t0
        yield server
    except BaseException:
        print(server.log()[-5000:], file=sys.stderr)
        raise
    finally:
        stop_process(proc)


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


# base URL -> API key of the servers serve_process started with one: under --api-key
# /metrics needs the key too (issue 43), and scrape() sends it.
API_KEYS: dict[str, str] = {}


def scrape(base_url: str) -> dict[str, float]:
    """GET /metrics (with the server's API key when serve_process started it with
    one), parsed by prometheus-client's parser: sample name -> value (labels other
    than model_name are appended as ``name{k=v}``)."""
    key = API_KEYS.get(base_url)
    return scrape_metrics(base_url, {"Authorization": f"Bearer {key}"} if key else None)


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
