"""Prefill/decode pools against colocated replicas on the interference workload.

    python benchmarks/pools_interference.py [--rate 0.5] [--workload ../shared/peer/workloads/interference.jsonl]

Starts ``kvserve serve`` twice on this machine, one after the other, with the same
engine options and one torch thread per replica:

- ``pools``: ``--prefill-replicas 1 --decode-replicas 1``
- ``colocated``: ``--replicas 2``

and sends every line of the workload (``{"prompt": text, "output_tokens": n}``) to
each, streamed, ``ignore_eos``, at Poisson arrivals of ``--rate`` per second (the same
seeded arrival times for both). Per run: requests failed, TTFT p50/p99, and the
inter-token latency (gap between two streamed chunks of one request) p50/p99 over
every request: the decode-side figure the target compares (pools' decode p99 ITL
<= 0.5 x colocated). Prints one JSON object per run and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "--threads-per-replica", "1", "--max-model-len", "8192", "--no-access-log",
    "--graceful-shutdown-timeout", "5",
]  # fmt: skip
CONFIGS = {
    "pools": ["--prefill-replicas", "1", "--decode-replicas", "1"],
    "colocated": ["--replicas", "2"],
}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def _one(
    client: httpx.AsyncClient, base: str, line: dict[str, Any], at: float, t0: float
) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    body = {
        "prompt": line["prompt"],
        "max_tokens": int(line["output_tokens"]),
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    sent = time.monotonic()
    times: list[float] = []
    try:
        async with client.stream("POST", base + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"ok": False, "error": f"HTTP {resp.status_code}"}
            async for raw in resp.aiter_lines():
                if not raw.startswith("data: ") or raw == "data: [DONE]":
                    continue
                event = json.loads(raw[6:])
                if "error" in event:
                    return {"ok": False, "error": event["error"]["message"]}
                if any(c.get("text") for c in event.get("choices", [])):
                    times.append(time.monotonic())
    except httpx.HTTPError as e:
        return {"ok": False, "error": repr(e)}
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"ok": True, "ttft": times[0] - sent if times else None, "itl": gaps}


async def _drive(base: str, lines: list[dict[str, Any]], arrivals: list[float]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(_one(client, base, line, at, t0) for line, at in zip(lines, arrivals, strict=True))
        )
        wall = time.monotonic() - t0
    ok = [r for r in results if r["ok"]]
    itl = [g for r in ok for g in r["itl"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:3],
        "wall_s": round(wall, 1),
        "ttft_p50_ms": ms(_percentile(ttft, 50)),
        "ttft_p99_ms": ms(_percentile(ttft, 99)),
        "itl_p50_ms": ms(_percentile(itl, 50)),
        "itl_p99_ms": ms(_percentile(itl, 99)),
        "itl_samples": len(itl),
    }


def _serve(name: str, port: int, log: Path, extra: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port)]
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*cmd, *COMMON, *CONFIGS[name], *extra],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base} not healthy in {timeout_s} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workload", default=str(REPO.parent / "shared/peer/workloads/interference.jsonl")
    )
    p.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--configs", default="pools,colocated")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument(
        "--pool-args",
        default="",
        help='extra flags for the pools run only, e.g. "--kv-remote-min-tokens 256"',
    )
    args = p.parse_args()
    lines = [json.loads(x) for x in Path(args.workload).read_text().splitlines() if x.strip()]
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in lines:
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    out: dict[str, dict[str, Any]] = {}
    for name in args.configs.split(","):
        base = f"http://127.0.0.1:{args.port}"
        extra = args.pool_args.split() if name == "pools" else []
        proc = _serve(name, args.port, Path(args.log_dir) / f"pools_bench_{name}.log", extra)
        try:
            t_start = time.monotonic()
            _wait_healthy(base, proc, 300)
            ready_s = time.monotonic() - t_start
            # one untimed request per replica kind: first-call costs out of the figures
            for _ in range(2):
                httpx.post(
                    base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120
                )
            result = asyncio.run(_drive(base, lines, arrivals))
            result["ready_s"] = round(ready_s, 1)
            out[name] = result
            row = {"config": name, "extra": " ".join(extra), "rate": args.rate, **result}
            print(json.dumps(row), flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if "pools" in out and "colocated" in out:
        a, b = out["pools"]["itl_p99_ms"], out["colocated"]["itl_p99_ms"]
        if a is not None and b:
            print(json.dumps({"itl_p99_ratio_pools_over_colocated": round(a / b, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
