"""Fuzz request-supplied structures against a live ``kvserve serve`` (issue 43).

    python benchmarks/fuzz_structures.py [--cases 2000] [--seed 0] [--max-seconds 900]
                                         [--url http://127.0.0.1:8000] [--api-key KEY]

Without ``--url`` it starts ``kvserve serve`` (default model, 127.0.0.1, a free port)
and stops it at the end. The corpus (seeded, reproducible) mixes:

- Lark grammars: chains of 1..6,000 rules, brackets nested 1..400 deep, wide
  alternations, left recursion, huge literals, GBNF, garbage;
- regexes: nested groups 1..600 deep, nested quantifiers ``(a+)+``, ``{n,m}``
  counts up to 10^9, wide classes, lookarounds and backreferences (unsupported),
  unbalanced brackets, long alternations;
- JSON schemas: nesting 1..120 deep, 1..5,000 properties, recursive ``$ref``
  (self-only too), ``pattern`` regexes, huge ``enum``, wide ``anyOf``, bad types;
  sent as ``structured_outputs.json``, ``response_format`` and as a tool's
  ``parameters`` with ``tool_choice: "required"``;
- choices: 1..3,000 strings.

Each case is one request (``max_tokens`` 1..4), 4 in flight. A poller GETs
``/health`` every 50 ms throughout. Printed at the end (and as JSON with --json):
cases, status counts, 5xx, transport errors, whether the server process died
(crashes), /health p50 / p99 / max. Exit status 1 on any crash or 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from kvserve.bench.process import free_port, stop_process, wait_healthy

REPO = Path(__file__).resolve().parents[1]


def _chain(n: int) -> str:
    rules = "\n".join(f'r{i}: "t{i}" r{i + 1} | "e{i}"' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "z"'


def gen_grammar(rng: random.Random) -> str:
    k = rng.randrange(8)
    if k == 0:
        return _chain(rng.choice([1, 10, 100, 500, 999, 1500, 3000, 6000]))
    if k == 1:
        d = rng.choice([1, 10, 50, 63, 65, 100, 400])
        return "start: " + "(" * d + '"a"' + ")" * d
    if k == 2:
        n = rng.choice([10, 1000, 5000, 20000])
        return "start: " + " | ".join(f'"w{i}"' for i in range(n))
    if k == 3:
        return 'start: start "a" | "b"'  # left recursion
    if k == 4:
        return 'start: "' + "x" * rng.choice([10, 10_000, 300_000]) + '"'
    if k == 5:
        return 'root ::= "yes" | "no" | item\nitem ::= [a-z]+'
    if k == 6:
        return "".join(rng.choice('()[]{}|*+?:"ab \n') for _ in range(rng.randrange(1, 400)))
    d = rng.choice([5, 30, 70])
    return "start: " + "[" * d + '"a"' + "]" * d + "\nx: /[a-z]{1,5}/"


def gen_regex(rng: random.Random) -> str:
    k = rng.randrange(9)
    if k == 0:
        d = rng.choice([1, 20, 63, 65, 200, 600])
        return "(" * d + "a" + ")" * d
    if k == 1:
        return rng.choice(["(a+)+b", "(a*)*", "((a|aa)+)+$", "(.*){20}", "(a|b|ab)*c"])
    if k == 2:
        n = rng.choice([5, 100, 1000, 1001, 50_000, 10**9])
        return f"a{{{n}}}" if rng.random() < 0.5 else f"(ab{{1,{n}}}){{2,{n}}}"
    if k == 3:
        return (
            "["
            + "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(1, 3000)))
            + "]"
        )
    if k == 4:
        return rng.choice(["(?=a)b", r"(a)\1", "(?<=x)y", "(?P<n>a)(?P=n)"])
    if k == 5:
        return rng.choice(["(", ")", "[a-", "a{2,1}", "*a", "\\"])
    if k == 6:
        return "|".join(f"w{i}" for i in range(rng.choice([10, 1000, 4000])))
    if k == 7:
        return "(" + "(a|b)?" * rng.choice([10, 100, 1000]) + ")"
    return "[0-9]{3}-[a-z]+"


def _deep(depth: int, kind: str) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        if kind == "array":
            node = {"type": "array", "items": node}
        elif kind == "anyof":
            node = {"anyOf": [node, {"type": "null"}]}
        else:
            node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    return node


def gen_schema(rng: random.Random) -> Any:
    k = rng.randrange(9)
    if k == 0:
        return _deep(rng.choice([1, 5, 15, 31, 33, 60]), rng.choice(["object", "array", "anyof"]))
    if k == 1:
        n = rng.choice([1, 100, 1000, 5000])
        props = {f"p{i}": {"type": rng.choice(["string", "integer", "boolean"])} for i in range(n)}
        return {"type": "object", "properties": props, "required": list(props)[: n // 2]}
    if k == 2:
        return {
            "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
            "$ref": "#/$defs/n",
        }
    if k == 3:
        return {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    if k == 4:
        return {"type": "string", "pattern": gen_regex(rng)}
    if k == 5:
        return {"enum": [f"v{i}" for i in range(rng.choice([1, 1000, 30000]))]}
    if k == 6:
        return {
            "anyOf": [
                {"type": "object", "properties": {f"k{i}": {"const": i}}}
                for i in range(rng.choice([2, 200, 3000]))
            ]
        }
    if k == 7:
        return rng.choice(
            [{"type": "nope"}, {"properties": 5}, {"$ref": "#/missing"}, {"minLength": -1}]
        )
    return {"type": "object", "properties": {"name": {"type": "string"}}}


def gen_case(rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """(name, path, body)."""
    k = rng.randrange(7)
    base: dict[str, Any] = {"prompt": "hi", "max_tokens": rng.randint(1, 4)}
    if k == 0:
        return (
            "grammar",
            "/v1/completions",
            {**base, "structured_outputs": {"grammar": gen_grammar(rng)}},
        )
    if k == 1:
        return "regex", "/v1/completions", {**base, "structured_outputs": {"regex": gen_regex(rng)}}
    if k == 2:
        return (
            "schema",
            "/v1/completions",
            {**base, "structured_outputs": {"json": gen_schema(rng)}},
        )
    if k == 3:
        return (
            "schema-text",
            "/v1/completions",
            {
                **base,
                "structured_outputs": {"json": json.dumps(gen_schema(rng))},
            },
        )
    if k == 4:
        choices = [f"c{i}" * rng.randint(1, 3) for i in range(rng.choice([1, 10, 1000, 3000]))]
        return "choice", "/v1/completions", {**base, "structured_outputs": {"choice": choices}}
    if k == 5:
        return (
            "response_format",
            "/v1/completions",
            {
                **base,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": gen_schema(rng)},
                },
            },
        )
    schema = gen_schema(rng)
    return (
        "tool",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": rng.randint(8, 16),
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
            "tool_choice": "required",
        },
    )


def start_server(extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
        "--port", str(port), "--max-model-len", "1024", "--num-kv-blocks", "512",
        "--max-num-seqs", "8", "--no-access-log", "--log-level", "warning", *extra,
    ]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 300, poll_s=0.5)
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def run(
    url: str,
    cases: int,
    seed: int,
    max_s: float,
    headers: dict[str, str],
    proc: subprocess.Popen[bytes] | None,
) -> dict[str, Any]:
    rng = random.Random(seed)
    corpus = [gen_case(rng) for _ in range(cases)]
    statuses: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    transport_errors = 0
    health: list[float] = []
    health_fail = 0
    done = asyncio.Event()
    slowest: list[tuple[float, str]] = []
    t_start = time.monotonic()

    async def poll_health() -> None:
        nonlocal health_fail
        async with httpx.AsyncClient(timeout=10) as client:
            while not done.is_set():
                t0 = time.perf_counter()
                try:
                    r = await client.get(url + "/health")
                    if r.status_code != 200:
                        health_fail += 1
                except httpx.TransportError:
                    health_fail += 1
                health.append((time.perf_counter() - t0) * 1000)
                await asyncio.sleep(0.05)

    queue: asyncio.Queue[tuple[str, str, dict[str, Any]]] = asyncio.Queue()
    for c in corpus:
        queue.put_nowait(c)

    async def worker() -> None:
        nonlocal transport_errors
        async with httpx.AsyncClient(timeout=120, headers=headers) as client:
            while not queue.empty() and time.monotonic() - t_start < max_s:
                name, path, body = queue.get_nowait()
                kinds[name] += 1
                t0 = time.perf_counter()
                try:
                    r = await client.post(url + path, json=body)
                    statuses[str(r.status_code)] += 1
                except httpx.TransportError:
                    transport_errors += 1
                    statuses["transport"] += 1
                slowest.append(((time.perf_counter() - t0) * 1000, name))

    poller = asyncio.ensure_future(poll_health())
    await asyncio.gather(*(worker() for _ in range(4)))
    done.set()
    await poller
    crashed = proc is not None and proc.poll() is not None
    sent = sum(kinds.values())
    slowest.sort(reverse=True)
    return {
        "cases": sent,
        "seconds": round(time.monotonic() - t_start, 1),
        "kinds": dict(kinds),
        "statuses": dict(statuses),
        "5xx": sum(v for k, v in statuses.items() if k.startswith("5")),
        "transport_errors": transport_errors,
        "crashed": crashed,
        "health_samples": len(health),
        "health_failures": health_fail,
        "health_p50_ms": round(percentile(health, 0.5), 1),
        "health_p99_ms": round(percentile(health, 0.99), 1),
        "health_max_ms": round(max(health, default=float("nan")), 1),
        "slowest_request_ms": [(round(t), n) for t, n in slowest[:5]],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=900)
    ap.add_argument("--url", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("server_args", nargs="*", help="extra kvserve serve flags (after --)")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.server_args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        result = asyncio.run(run(url, args.cases, args.seed, args.max_seconds, headers, proc))
    finally:
        stop_process(proc)
    print(json.dumps(result, indent=None if args.json else 2))
    return 1 if result["crashed"] or result["5xx"] or result["transport_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
