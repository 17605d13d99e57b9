"""Slowloris against a live ``kvserve serve``: do N slow sockets stop a normal client?

    python benchmarks/slow_sockets.py [--sockets 500] [--seconds 30] [--url URL]
                                      [-- extra kvserve serve flags]

Without ``--url`` it starts ``kvserve serve`` (default model, 127.0.0.1, a free port,
default connection limits: --header-timeout 10, --limit-concurrency 1024). Then:

- ``--sockets`` connections each send a request line and one header line every
  ``--drip`` seconds (default 2), never finishing the headers; a socket the server
  closes is reopened at once (the attacker keeps N open);
- one hard schema (a recursive ``$ref`` object with patterns) is sent as a first
  compile while they are open;
- a normal client GETs ``/health`` every 50 ms and sends a short completion every
  second, for ``--seconds``.

Printed: N, how many slow sockets the server cut (408) and after how long, the
normal client's /health p50 / p99 / max and completion latencies, its failures.
Bounded: every loop stops at ``--seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from fuzz_structures import percentile, start_server  # noqa: E402

from kvserve.bench.process import stop_process  # noqa: E402

HARD_SCHEMA: dict[str, Any] = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z]{1,20}(-[a-z0-9]{1,8}){0,4}$"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                "meta": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
            "required": ["name", "children"],
        }
    },
    "$ref": "#/$defs/node",
}


async def slow_socket(
    host: str, port: int, drip: float, stop: float, stats: dict[str, Any]
) -> None:
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            stats["connect_errors"] += 1
            await asyncio.sleep(0.5)
            continue
        opened = time.monotonic()
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
            i = 0
            while time.monotonic() < stop:
                try:
                    data = await asyncio.wait_for(reader.read(4096), timeout=drip)
                except TimeoutError:
                    writer.write(f"X-Slow-{i}: 1\r\n".encode())
                    await writer.drain()
                    i += 1
                    continue
                if data.startswith(b"HTTP/1.1 408"):
                    stats["cut_408"] += 1
                    stats["held_s"].append(time.monotonic() - opened)
                elif data.startswith(b"HTTP/1.1 503"):
                    stats["refused_503"] += 1
                break
        except (ConnectionError, OSError):
            stats["reset"] += 1
        finally:
            writer.close()


async def run(url: str, n: int, seconds: float, drip: float) -> dict[str, Any]:
    host, port = url.split("//")[1].split(":")
    stop = time.monotonic() + seconds
    stats: dict[str, Any] = {
        "cut_408": 0,
        "refused_503": 0,
        "reset": 0,
        "connect_errors": 0,
        "held_s": [],
    }
    slow = [
        asyncio.ensure_future(slow_socket(host, int(port), drip, stop, stats)) for _ in range(n)
    ]
    await asyncio.sleep(min(3.0, seconds / 4))  # let them open
    health: list[float] = []
    completions: list[float] = []
    failures: list[str] = []
    async with httpx.AsyncClient(timeout=60) as client:

        async def hard_compile() -> float:
            t0 = time.perf_counter()
            r = await client.post(
                url + "/v1/completions",
                json={
                    "prompt": "tree:",
                    "max_tokens": 8,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "t", "schema": HARD_SCHEMA},
                    },
                },
            )
            if r.status_code >= 500:
                failures.append(f"hard schema {r.status_code}")
            return time.perf_counter() - t0

        compile_task = asyncio.ensure_future(hard_compile())

        async def poll() -> None:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                try:
                    r = await client.get(url + "/health")
                    if r.status_code != 200:
                        failures.append(f"health {r.status_code}")
                except httpx.TransportError as e:
                    failures.append(f"health {type(e).__name__}")
                health.append((time.perf_counter() - t0) * 1000)
                await asyncio.sleep(0.05)

        async def complete() -> None:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                try:
                    r = await client.post(
                        url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}
                    )
                    if r.status_code != 200:
                        failures.append(f"completion {r.status_code}")
                except httpx.TransportError as e:
                    failures.append(f"completion {type(e).__name__}")
                completions.append((time.perf_counter() - t0) * 1000)
                await asyncio.sleep(1.0)

        await asyncio.gather(poll(), complete())
        compile_s = await compile_task
    await asyncio.gather(*slow, return_exceptions=True)
    held = stats.pop("held_s")
    return {
        "slow_sockets": n,
        "seconds": seconds,
        **stats,
        "slow_socket_held_s_median": round(percentile(held, 0.5), 1) if held else None,
        "health_samples": len(health),
        "health_p50_ms": round(percentile(health, 0.5), 1),
        "health_p99_ms": round(percentile(health, 0.99), 1),
        "health_max_ms": round(max(health, default=float("nan")), 1),
        "completions": len(completions),
        "completion_p50_ms": round(percentile(completions, 0.5), 1),
        "completion_max_ms": round(max(completions, default=float("nan")), 1),
        "hard_schema_first_compile_s": round(compile_s, 2),
        "normal_client_failures": failures[:10],
        "normal_client_failure_count": len(failures),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sockets", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--drip", type=float, default=2.0)
    ap.add_argument("--url", default=None)
    ap.add_argument("server_args", nargs="*")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.server_args)
    try:
        result = asyncio.run(run(url, args.sockets, min(args.seconds, 300), args.drip))
    finally:
        stop_process(proc)
    result["server_alive_at_end"] = proc is None or proc.returncode in (0, None)
    print(json.dumps(result, indent=2))
    return 1 if result["normal_client_failure_count"] else 0


if __name__ == "__main__":
    sys.exit(main())
