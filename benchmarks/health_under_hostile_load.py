"""``/health`` latency while hostile requests are in flight (issue 21's target:
p99 < 100 ms while a 20 MB body, a 1,000-prompt request and a hostile template
request are in flight).

    python benchmarks/health_under_hostile_load.py                 # this checkout
    python benchmarks/health_under_hostile_load.py --legacy --repo /work/main
                                                                  # before the fix

Starts ``kvserve serve`` (default model, 127.0.0.1, a free port), then, at once:

- a 20 MB completion prompt (``--max-request-body-bytes`` raised to 32 MB so it is
  parsed and tokenized, not refused early; ``--body-limit-default`` keeps the
  default limit, which answers 413 before reading it);
- a completion request with 1,000 short prompts (``max_tokens`` 1);
- a chat request whose template loops 16 M times (sent as ``chat_template`` with
  ``--trust-request-chat-template``; ``--legacy`` sends it in
  ``chat_template_kwargs``, which servers before the fix accepted);

while one client polls ``/health`` every 10 ms until all three have answered.
Prints the latency percentiles and each request's status. Timings on a shared
machine are noisy: compare runs made one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvserve.bench.process import free_port, stop_process, wait_healthy

HOSTILE = "{% for a in range(4000) %}{% for b in range(4000) %}{% endfor %}{% endfor %}x"


def _start(repo: Path, args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(repo))
    env.pop("KVSERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [*cmd, *args], cwd=repo, stdout=f, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 300, poll_s=0.3, log_tail=lambda: log.read_text()[-2000:])
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(url: str, legacy: bool, body_mb: int, window_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {}

    def post(name: str, path: str, body: bytes) -> None:
        t0 = time.monotonic()
        try:
            r = httpx.post(
                url + path,
                content=body,
                headers={"Content-Type": "application/json"},
                timeout=600,
            )
            status: Any = r.status_code
            detail = r.text[:160] if r.status_code >= 400 else ""
        except httpx.HTTPError as e:
            status, detail = type(e).__name__, str(e)[:160]
        results[name] = {"status": status, "s": round(time.monotonic() - t0, 2), "detail": detail}

    big = json.dumps({"prompt": "hello world " * (body_mb * 1024 * 1024 // 12), "max_tokens": 1})
    many = json.dumps({"prompt": [f"prompt number {i}" for i in range(1000)], "max_tokens": 1})
    chat: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    if legacy:
        chat["chat_template_kwargs"] = {"chat_template": HOSTILE}
    else:
        chat["chat_template"] = HOSTILE
    loads = [
        threading.Thread(target=post, args=("20MB body", "/v1/completions", big.encode())),
        threading.Thread(target=post, args=("1000 prompts", "/v1/completions", many.encode())),
        threading.Thread(
            target=post,
            args=("hostile template", "/v1/chat/completions", json.dumps(chat).encode()),
        ),
    ]
    latencies: list[float] = []
    sent_at: list[float] = []
    with httpx.Client(timeout=60) as client:
        client.get(url + "/health")
        start = time.perf_counter()
        for t in loads:
            t.start()
        end = time.monotonic() + window_s
        while any(t.is_alive() for t in loads) and time.monotonic() < end:
            t0 = time.perf_counter()
            client.get(url + "/health")
            latencies.append(time.perf_counter() - t0)
            sent_at.append(t0 - start)
            time.sleep(0.01)
    ms = [x * 1000 for x in latencies]
    slow = sorted(
        ((round(t, 2), round(x * 1000, 1)) for t, x in zip(sent_at, latencies, strict=True)),
        key=lambda p: -p[1],
    )[:5]
    return {
        "slowest_at_s_ms": slow,
        "health_samples": len(ms),
        "health_ms": {
            "p50": round(statistics.median(ms), 1),
            "p99": round(_pct(ms, 0.99), 1),
            "max": round(max(ms), 1),
        },
        "requests": results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--url", default=None, help="use this running server instead")
    parser.add_argument("--legacy", action="store_true", help="a server without the new flags")
    parser.add_argument("--body-limit-default", action="store_true")
    parser.add_argument("--body-mb", type=int, default=20)
    parser.add_argument(
        "--server-args",
        default="--max-prompts-per-request 1000",
        help="extra server flags (default: let the 1,000-prompt request in, past the "
        "default --max-prompts-per-request 256, so it runs while /health is sampled)",
    )
    parser.add_argument(
        "--window-s", type=float, default=600, help="stop sampling /health after this long"
    )
    args = parser.parse_args()
    proc = None
    url = args.url
    if url is None:
        flags = ["--no-access-log", "--max-model-len", "2048"]
        if not args.legacy:
            flags += ["--trust-request-chat-template"]
            if not args.body_limit_default:
                flags += ["--max-request-body-bytes", str(32 * 1024 * 1024)]
        if not args.legacy:
            flags += args.server_args.split()
        log = Path(f"/tmp/health_bench_{os.getpid()}.log")
        proc, url = _start(args.repo, flags, log)
    try:
        out = run(url, args.legacy, args.body_mb, args.window_s)
    finally:
        stop_process(proc, timeout_s=60)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
