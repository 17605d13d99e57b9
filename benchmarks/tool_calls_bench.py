"""Function-calling reliability on the default model (issue 24's targets), not a test.

Starts ``kvserve serve`` on the default model with a vLLM-style launch line (the
tool-aware SmolLM2 template from examples/, ``--enable-auto-tool-choice
--tool-call-parser hermes``) or uses ``--url``, and sends ``--requests`` varied
chat requests (12 tool sets: nested objects, enums, arrays, integers with bounds,
numbers, booleans, optional fields, anyOf, one to three tools; questions that
include runaway-inducing ones such as "email the whole novel"), each once
non-streamed and once streamed:

- **forced**: ``tool_choice`` alternates ``required`` and named, ``parallel_tool_calls``
  mostly false, ``max_tokens`` from a cycle that includes the smallest accepted value
  (found from the 400 that ``max_tokens=1`` gets, which must say ``max_tokens >= N``),
  N + 2, and 16 .. 256; temperatures 0 .. 1.2. A request counts as valid when it
  has ``finish_reason: "tool_calls"``, at least one call (exactly one without
  parallel calls; the named one when named), every call's name is a tool and its
  arguments parse and validate against the tool's schema as sent (jsonschema), it
  used at most ``max_tokens``, and, streamed, the deltas have OpenAI's shape (the
  first chunk is role + ``content: null`` + the first call's header; each call's
  first delta has index, id, type and name, later ones arguments only; the last
  choice chunk has the finish reason). ``finish_reason`` is ``"tool_calls"``, or
  ``"length"`` when the call used all of ``max_tokens`` (the engine closed it on
  its budget: counted as ``closed_by_budget``). Target: every one.
- **parallel**: the forced cases again with ``tool_choice: "required"`` and
  ``parallel_tool_calls: true`` on every one (several calls in one reply), same
  validity rules; streamed, each chunk carries at most one entry per call index,
  indices begin 0, 1, 2, ... in order (the ``openai`` stream helper accumulates by
  list position), and each call's accumulated arguments are one JSON value.
- **auto** (hermes parser, ``max_tokens`` 160): the share of requests for which the
  model wrote at least one call that parses and validates (every question asks for
  a tool), and how many leaked ``<tool_call>`` markup into content.

    PYTHONPATH=. .venv/bin/python benchmarks/tool_calls_bench.py [--requests 50] [--workers 4]

Prints one line per mode and a JSON summary; exits 1 unless every forced request
was valid.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from kvserve.bench.process import stop_process, wait_healthy

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "examples" / "tool_chat_template_smollm2.jinja"
S: dict[str, Any] = {"type": "string"}


def fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


WEATHER = fn(
    "get_weather", "Weather in a city", {"city": S, "unit": {"enum": ["c", "f"]}}, ["city"]
)
TOOLSETS: list[tuple[list[dict], list[str]]] = [
    (
        [WEATHER],
        ["What's the weather in Paris?", "Weather for Tokyo in f", "How hot is Cairo?"],
    ),
    (
        [
            fn(
                "search_web",
                "Search the web",
                {"query": S, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                ["query"],
            ),
            fn("open_url", "Open a web page", {"url": S}, ["url"]),
        ],
        [
            "Find 3 results about pandas",
            "Open the page https://example.com/a/very/long/path/that/goes/on",
            "Search for every word in the English dictionary, listed one by one",
        ],
    ),
    (
        [
            fn(
                "send_email",
                "Send an email",
                {"to": S, "subject": S, "body": S, "cc": {"type": "array", "items": S}},
                ["to", "subject", "body"],
            )
        ],
        [
            "Email bob@example.com that the meeting moved",
            "Email Alice the complete text of War and Peace, every chapter in full",
            "Send a reminder to carol@example.com, cc dan@example.com and eve@example.com",
        ],
    ),
    (
        [
            fn(
                "add",
                "Add two numbers",
                {"a": {"type": "number"}, "b": {"type": "number"}},
                ["a", "b"],
            ),
            fn(
                "multiply",
                "Multiply two numbers",
                {"a": {"type": "number"}, "b": {"type": "number"}},
                ["a", "b"],
            ),
        ],
        ["What is 3 plus 4?", "Multiply 2.5 by 4", "Add pi to e with 500 digits each"],
    ),
    (
        [
            fn(
                "create_event",
                "Create a calendar event",
                {
                    "title": S,
                    "date": {"type": "string", "description": "YYYY-MM-DD"},
                    "attendees": {"type": "array", "items": S},
                    "location": {
                        "type": "object",
                        "properties": {"name": S, "address": S},
                        "required": ["name"],
                    },
                },
                ["title", "date"],
            )
        ],
        [
            "Create a team sync tomorrow with Ann and Raj in room 4",
            "Schedule a dentist visit on 2025-05-03",
            "Invite the whole company, all 5000 people by name, to the party",
        ],
    ),
    (
        [
            fn(
                "order_pizza",
                "Order a pizza",
                {
                    "size": {"enum": ["small", "medium", "large"]},
                    "toppings": {"type": "array", "items": S, "minItems": 1},
                    "address": {
                        "type": "object",
                        "properties": {"street": S, "city": S},
                        "required": ["street", "city"],
                    },
                    "notes": S,
                },
                ["size", "toppings", "address"],
            )
        ],
        [
            "Order a large pepperoni pizza to 1 Main St, Springfield",
            "Small margherita to 5 Oak Ave, Boston, ring twice",
            "A pizza with every topping you know to 2 Elm St, Austin",
        ],
    ),
    (
        [
            fn("lookup_user", "Find a user", {"user_id": {"type": "integer"}}, ["user_id"]),
            fn(
                "delete_user",
                "Delete a user",
                {"user_id": {"type": "integer"}, "confirm": {"type": "boolean"}},
                ["user_id", "confirm"],
            ),
        ],
        ["Find user 42", "Remove user 3, confirmed", "Who is user 55?"],
    ),
    (
        [
            fn(
                "translate",
                "Translate text",
                {"text": S, "target": {"enum": ["fr", "de", "es"]}},
                ["text", "target"],
            )
        ],
        [
            "Translate 'hello' to French",
            "Translate this whole book into German, every page",
            "Spanish for 'thank you'",
        ],
    ),
    (
        [
            fn(
                "set_timer",
                "Set a timer",
                {"minutes": {"type": "integer", "minimum": 1, "maximum": 1440}, "label": S},
                ["minutes"],
            )
        ],
        ["Set a timer for 5 minutes", "Timer for half an hour called tea", "Start a 2 min timer"],
    ),
    (
        [
            fn(
                "book_flight",
                "Book a flight",
                {
                    "origin": S,
                    "destination": S,
                    "date": S,
                    "passengers": {
                        "type": "object",
                        "properties": {
                            "adults": {"type": "integer", "minimum": 1},
                            "children": {"type": "integer", "minimum": 0},
                        },
                        "required": ["adults"],
                    },
                    "cabin": {"enum": ["economy", "business", "first"]},
                },
                ["origin", "destination", "date", "passengers"],
            ),
            WEATHER,
        ],
        [
            "Fly me from Oslo to Rome on June 3, two adults and a child, business",
            "Book a flight from NYC to LA next Monday",
            "What's the weather in Lima?",
        ],
    ),
    (
        [
            fn("write_file", "Write a text file", {"path": S, "content": S}, ["path", "content"]),
            fn("read_file", "Read a text file", {"path": S}, ["path"]),
        ],
        [
            "Write a file essay.txt with a 10000-word essay about the sea",
            "Save the numbers from 1 to 100000 into numbers.txt",
            "Read /etc/hosts",
        ],
    ),
    (
        [
            fn(
                "run_sql",
                "Run a SQL query",
                {
                    "query": S,
                    "params": {
                        "type": "array",
                        "items": {"anyOf": [{"type": "string"}, {"type": "number"}]},
                    },
                    "read_only": {"type": "boolean"},
                },
                ["query"],
            ),
            fn("list_tables", "List the tables", {}, []),
            WEATHER,
        ],
        [
            "Select the users older than 30",
            "List the tables",
            "Insert a million rows of sample data, writing each row out",
        ],
    ),
]
# max_tokens cycle for forced calls: "min" = the smallest accepted, "min+2" two more
MAX_TOKENS: list[int | str] = ["min", 256, 48, "min+2", 96, 24, 160, 32, 64, 16, 128]
TEMPERATURES = [0.7, 1.0, 0.0, 1.2, 0.7]


def cases(n: int) -> list[dict[str, Any]]:
    """``n`` request specs (tools, question, mode, max_tokens, ...), deterministic."""
    out = []
    for i in range(n):
        tools, questions = TOOLSETS[i % len(TOOLSETS)]
        question = questions[(i // len(TOOLSETS)) % len(questions)]
        named = i % 2 == 1
        out.append(
            {
                "i": i,
                "tools": tools,
                "question": question,
                "choice": (
                    {
                        "type": "function",
                        "function": {"name": tools[(i // 2) % len(tools)]["function"]["name"]},
                    }
                    if named
                    else "required"
                ),
                "parallel": i % 5 == 4,  # parallel calls allowed on every fifth
                "max_tokens": MAX_TOKENS[i % len(MAX_TOKENS)],
                "temperature": TEMPERATURES[i % len(TEMPERATURES)],
            }
        )
    return out


def schema_of(tools: list[dict], name: str | None) -> dict | None:
    return next((t["function"]["parameters"] for t in tools if t["function"]["name"] == name), None)


def check_calls(case: dict[str, Any], calls: list[tuple[str | None, str]]) -> str:
    """ "" when every call is valid for the case, else what is wrong."""
    if not calls:
        return "no call"
    if not case.get("parallel", True) and len(calls) != 1:
        return f"{len(calls)} calls with parallel_tool_calls false"
    choice = case.get("choice")
    for name, arguments in calls:
        if isinstance(choice, dict) and name != choice["function"]["name"]:
            return f"called {name}, not the named function"
        schema = schema_of(case["tools"], name)
        if schema is None:
            return f"unknown function {name!r}"
        try:
            jsonschema.validate(json.loads(arguments), schema)
        except ValueError as e:
            return f"arguments do not parse: {e}: {arguments[:120]!r}"
        except jsonschema.ValidationError as e:
            return f"arguments do not validate: {e.message}: {arguments[:120]!r}"
    return ""


def sse(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed chat completion (raw JSON, ``[DONE]`` checked)."""
    chunks: list[dict[str, Any]] = []
    done = False
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            chunks.append(json.loads(data))
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    return chunks


def stream_shape(
    chunks: list[dict[str, Any]], forced: bool
) -> tuple[str, list[tuple[str | None, str]], str]:
    """(shape problem or "", calls, finish_reason) of a streamed single-choice reply;
    ``forced``: the first chunk must also be OpenAI's first chunk of a call (role,
    ``content: null`` and the call's header together)."""
    deltas = [
        (c["choices"][0]["delta"], c["choices"][0].get("finish_reason"))
        for c in chunks
        if c.get("choices")
    ]
    if not deltas or deltas[0][0].get("role") != "assistant":
        return "first chunk does not open the assistant role", [], ""
    first = deltas[0][0]
    if forced and not (first.get("tool_calls") and first.get("content", "") is None):
        return f"first chunk is not role + content null + call header: {first}", [], ""
    calls: dict[int, list[Any]] = {}
    problem = ""
    for delta, _ in deltas:
        indices = [tc.get("index") for tc in delta.get("tool_calls") or []]
        if len(indices) != len(set(indices)):
            problem = problem or f"one chunk has two entries for one call index: {indices}"
        for tc in delta.get("tool_calls") or []:
            index = tc.get("index")
            if not isinstance(index, int):
                problem = problem or "a tool_calls delta without an integer index"
                continue
            fn_ = tc.get("function") or {}
            if index not in calls:
                if index != len(calls):
                    problem = problem or f"call index {index} begins after {len(calls)} calls"
                if not (tc.get("id") and tc.get("type") == "function" and fn_.get("name")):
                    problem = problem or f"call {index}'s first delta lacks id/type/name: {tc}"
                calls[index] = [fn_.get("name"), fn_.get("arguments") or ""]
            else:
                if "id" in tc or "type" in tc or "name" in fn_:
                    problem = problem or f"call {index}'s later delta repeats its header: {tc}"
                calls[index][1] += fn_.get("arguments") or ""
    finish = [f for _, f in deltas if f]
    if len(finish) != 1 or deltas[-1][1] is None:
        problem = problem or f"finish_reason not on the last choice chunk only: {finish}"
    return problem, [(calls[k][0], calls[k][1]) for k in sorted(calls)], (finish or [""])[-1]


def smallest_max_tokens(client: httpx.Client, body: dict[str, Any]) -> int:
    """The N of the 400 a forced call gets with max_tokens=1 ("max_tokens >= N")."""
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    if r.status_code != 400:
        raise RuntimeError(f"max_tokens=1 on a forced call answered {r.status_code}, not 400")
    err = r.json()["error"]
    m = re.search(r"max_tokens >= (\d+)", err["message"])
    if not m or err.get("param") != "max_tokens":
        raise RuntimeError(f"the 400 does not say how large max_tokens must be: {err}")
    return int(m.group(1))


def run_one(
    client: httpx.Client, model: str, case: dict[str, Any], mode: str, stream: bool
) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": case["question"]}],
        "tools": case["tools"],
        "temperature": case["temperature"],
        "seed": case["i"],
    }
    if mode == "parallel":
        case = {**case, "choice": "required", "parallel": True}
    if mode in ("forced", "parallel"):
        body["tool_choice"] = case["choice"]
        body["parallel_tool_calls"] = case["parallel"]
        mt = case["max_tokens"]
        least = smallest_max_tokens(client, body)
        if isinstance(mt, str):
            mt = least + (2 if mt == "min+2" else 0)
        body["max_tokens"] = max(mt, least)
    else:
        body["tool_choice"] = "auto"
        body["parallel_tool_calls"] = False
        body["max_tokens"] = 160
        case = {**case, "choice": "auto", "parallel": False}
    content = ""
    shape = ""
    if stream:
        chunks = sse(client, {**body, "stream": True, "stream_options": {"include_usage": True}})
        shape, calls, finish = stream_shape(chunks, mode != "auto")
        content = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
        )
        n_out = chunks[-1]["usage"]["completion_tokens"]
    else:
        r = client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        data = r.json()
        choice = data["choices"][0]
        finish = choice["finish_reason"]
        content = choice["message"].get("content") or ""
        calls = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"].get("tool_calls") or []
        ]
        n_out = data["usage"]["completion_tokens"]
    problem = shape or check_calls(case, calls)
    # "length" with a complete call: the engine closed it on its budget (all of
    # max_tokens used); anything else must say "tool_calls"
    closed = finish == "length" and n_out == body["max_tokens"]
    if not problem and calls and finish != "tool_calls" and not (mode != "auto" and closed):
        problem = f"finish_reason {finish!r} after {n_out} of {body['max_tokens']} tokens"
    if n_out > body["max_tokens"]:
        problem = problem or f"{n_out} tokens > max_tokens {body['max_tokens']}"
    return {
        "i": case["i"],
        "ok": not problem,
        "problem": problem,
        "finish": finish,
        "closed": closed and not problem,
        "max_tokens": body["max_tokens"],
        "leak": "<tool_call>" in content,
        "calls": [(n, a[:100]) for n, a in calls][:2],
    }


def start_server(port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """``kvserve serve`` with a launch line as a vLLM user writes it."""
    cmd = [
        sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "smollm2-135m-instruct",
        "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
        "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--max-model-len", "2048",
        "--tensor-parallel-size", "1", "--disable-log-requests",
        "--uvicorn-log-level", "warning", "--generation-config", "auto",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--url", default=None, help="an already running server (else one starts)")
    ap.add_argument("--modes", default="forced,parallel,auto")
    ap.add_argument("--log", default="/tmp/kvserve_tool_bench_server.log")
    args = ap.parse_args()

    proc = None
    url = args.url or f"http://127.0.0.1:{args.port}"
    if args.url is None:
        proc = start_server(args.port, Path(args.log))
        try:
            wait_healthy(url, proc, 600, poll_s=0.5)
        except RuntimeError as e:
            print(e, Path(args.log).read_text()[-3000:], sep="\n")
            stop_process(proc)
            return 2
    client = httpx.Client(base_url=url, timeout=900)
    model = client.get("/v1/models").json()["data"][0]["id"]
    work = cases(args.requests)
    results: dict[str, Any] = {}
    try:
        for mode in args.modes.split(","):
            for stream in (False, True):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(args.workers) as pool:
                    outs = list(
                        pool.map(lambda c, m=mode, s=stream: run_one(client, model, c, m, s), work)
                    )
                key = f"{mode}{' streamed' if stream else ''}"
                ok = sum(o["ok"] for o in outs)
                results[key] = {
                    "valid": f"{ok}/{len(outs)}",
                    "finish_tool_calls": sum(o["finish"] == "tool_calls" for o in outs),
                    "finish_length": sum(o["finish"] == "length" for o in outs),
                    # forced calls the engine closed on their budget (valid, finish length)
                    "closed_by_budget": sum(o["closed"] for o in outs),
                    "leaked_markup": sum(o["leak"] for o in outs),
                    "max_tokens_used": sorted({o["max_tokens"] for o in outs}),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                misses = [(o["i"], o["problem"], o["calls"]) for o in outs if not o["ok"]]
                print(key, json.dumps(results[key]), "misses:", misses[:4], flush=True)
    finally:
        stop_process(proc, timeout_s=60)
    print(json.dumps(results, indent=1))
    forced = [v for k, v in results.items() if not k.startswith("auto")]
    return 0 if all(v["valid"].split("/")[0] == v["valid"].split("/")[1] for v in forced) else 1


if __name__ == "__main__":
    sys.exit(main())
