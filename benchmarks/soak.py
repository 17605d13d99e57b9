"""Memory soak: does the server's RSS plateau under a long streaming load, and does it
give memory back once idle? (issue 21, memory)

Starts ``kvserve serve`` on 127.0.0.1 (or uses ``--url`` with ``--pid``), runs
``--clients`` streaming clients for ``--duration-s`` seconds (each sends a chat or a
completion with a varied prompt; every third client disconnects after a few chunks),
waits for the engine to finish or abort what was cut (phase ``drain``), then keeps
sampling through ``--idle-s`` seconds of idle (the engine trims after 120 s idle). The server's RSS (``/proc/PID/status`` VmRSS) is sampled every
``--sample-s`` seconds into ``--csv`` (elapsed_s, phase, rss_mb, requests_done,
disconnects, errors, running, waiting, active_blocks). At the end the server must
report 0 running, 0 waiting and 0 active KV blocks; the command exits 1 otherwise.

    nice -n 19 .venv/bin/python benchmarks/soak.py --duration-s 1800 --csv soak.csv
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvserve.bench.process import free_port, stop_process, wait_healthy

WORDS = (  # noqa: SIM905 (reads as a sentence)
    "river mountain engine cache token stream batch prefix block server memory request "
    "history science music garden ocean planet window letter market winter summer"
).split()


DRAIN_S = 60.0


def rss_mb(pid: int) -> float:
    """The process's resident set in MB (RuntimeError once it is gone)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvserve:num_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0].removeprefix("kvserve:")] = float(value)
    return out


class Counters:
    def __init__(self) -> None:
        self.done = 0
        self.disconnects = 0
        self.errors = 0


async def client(
    i: int, url: str, deadline: float, counters: Counters, max_tokens: int, seed: int
) -> None:
    rng = random.Random(seed * 1000 + i)
    disconnecter = i % 3 == 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0)) as http:
        while time.monotonic() < deadline:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120)))
            if rng.random() < 0.5:
                path = "/v1/chat/completions"
                body: dict[str, Any] = {"messages": [{"role": "user", "content": words}]}
            else:
                path = "/v1/completions"
                body = {"prompt": words}
            body |= {"max_tokens": rng.randint(8, max_tokens), "stream": True}
            cut_after = rng.randint(1, 6) if disconnecter else None
            try:
                async with http.stream("POST", url + path, json=body) as r:
                    if r.status_code != 200:
                        counters.errors += 1
                        await asyncio.sleep(0.5)
                        continue
                    chunks = 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        chunks += 1
                        if cut_after is not None and chunks >= cut_after:
                            counters.disconnects += 1
                            break
                        if line == "data: [DONE]":
                            counters.done += 1
            except httpx.HTTPError:
                counters.errors += 1
                await asyncio.sleep(0.5)


async def sampler(
    url: str,
    pid: int,
    start: float,
    phase: list[str],
    stop: asyncio.Event,
    counters: Counters,
    writer: Any,
    period_s: float,
) -> None:
    while not stop.is_set():
        try:
            g = await asyncio.to_thread(gauges, url)
        except httpx.HTTPError:
            g = {}
        try:
            rss = rss_mb(pid)
        except (OSError, RuntimeError):
            print(f"the server (pid {pid}) is gone", flush=True)
            writer.writerow([round(time.monotonic() - start, 1), "server-gone"])
            return
        row = [
            round(time.monotonic() - start, 1),
            phase[0],
            round(rss, 1),
            counters.done,
            counters.disconnects,
            counters.errors,
            g.get("num_requests_running", -1),
            g.get("num_requests_waiting", -1),
            g.get("num_active_blocks", -1),
        ]
        writer.writerow(row)
        print(",".join(str(x) for x in row), flush=True)
        with_timeout = asyncio.ensure_future(stop.wait())
        await asyncio.wait({with_timeout}, timeout=period_s)
        with_timeout.cancel()


async def soak(args: argparse.Namespace, url: str, pid: int) -> int:
    counters = Counters()
    phase = ["load"]
    stop = asyncio.Event()
    with open(args.csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "elapsed_s",
                "phase",
                "rss_mb",
                "requests_done",
                "disconnects",
                "errors",
                "running",
                "waiting",
                "active_blocks",
            ]
        )
        start = time.monotonic()
        sample = asyncio.create_task(
            sampler(url, pid, start, phase, stop, counters, writer, args.sample_s)
        )
        deadline = start + args.duration_s
        clients = [
            asyncio.create_task(client(i, url, deadline, counters, args.max_tokens, args.seed))
            for i in range(args.clients)
        ]
        # Past the deadline, requests still streaming get DRAIN_S, then are cut.
        _, late = await asyncio.wait(clients, timeout=args.duration_s + DRAIN_S)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        # The idle clock starts once the engine is idle (on a starved machine the
        # cut requests take a while to be aborted), at most DRAIN_S x 10 later.
        phase[0] = "drain"
        drain_end = time.monotonic() + 10 * DRAIN_S
        while time.monotonic() < drain_end:
            g = await asyncio.to_thread(gauges, url)
            if all(g.get(k, -1) == 0 for k in ("num_requests_running", "num_requests_waiting")):
                break
            await asyncio.sleep(2.0)
        phase[0] = "idle"
        await asyncio.sleep(args.idle_s)
        stop.set()
        await sample
        f.flush()
    final = gauges(url)
    leftover = {
        k: final.get(k, -1)
        for k in ("num_requests_running", "num_requests_waiting", "num_active_blocks")
    }
    summary = {
        "requests_done": counters.done,
        "disconnects": counters.disconnects,
        "errors": counters.errors,
        **leftover,
    }
    print(json.dumps(summary))
    return 0 if all(v == 0 for v in leftover.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="an already running server (needs --pid)")
    parser.add_argument("--pid", type=int, default=None, help="its process id (for the RSS)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--idle-s", type=float, default=150.0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", type=Path, default=Path("soak.csv"))
    parser.add_argument(
        "--startup-timeout-s", type=float, default=300.0, help="(nice 19 on a busy machine: more)"
    )
    parser.add_argument(
        "--server-args",
        default="--max-model-len 1024 --no-access-log",
        help="extra arguments for the server this command starts",
    )
    args = parser.parse_args()
    if args.url is not None:
        if args.pid is None:
            parser.error("--url needs --pid (the server's process id, for its RSS)")
        return asyncio.run(soak(args, args.url.rstrip("/"), args.pid))
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *args.server_args.split()]
    log = open(args.csv.with_suffix(".server.log"), "wb")  # noqa: SIM115 (lives with proc)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc, args.startup_timeout_s, poll_s=0.5)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 2
        return asyncio.run(soak(args, url, proc.pid))
    finally:
        stop_process(proc, timeout_s=60)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
