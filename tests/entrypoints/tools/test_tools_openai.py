"""Function calling through the official ``openai`` client on the default model:
forced calls (required, named) always parse and validate against the function's
schema, auto with the hermes parser, streamed deltas in OpenAI's shape, tool
messages in the history, and the refusals."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from support.tool_defs import MODEL, TIME, WEATHER

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def client(tool_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server + "/v1", api_key="unused", max_retries=0)


ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_calls_parse_and_validate(client: openai.OpenAI, choice) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_tokens=80,
        temperature=0.7,
        seed=1,
    )
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        check_call(call.function.name, call.function.arguments)
    if isinstance(choice, dict):
        assert [t.function.name for t in c.message.tool_calls] == ["get_time"]


def test_forced_call_streamed_like_openai(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    call_deltas = [tc for d in deltas for tc in (d.tool_calls or [])]
    first = call_deltas[0]
    assert first.id and first.type == "function" and first.function.name
    assert all(tc.id is None and tc.function.name is None for tc in call_deltas[1:])
    assert {tc.index for tc in call_deltas} == {0}  # parallel_tool_calls false: one call
    arguments = "".join(tc.function.arguments or "" for tc in call_deltas)
    check_call(first.function.name, arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # the same request not streamed gives the same call
    full = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    (call,) = full.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == (first.function.name, arguments)


@pytest.mark.parametrize("seed", [0, 3, 7])
def test_streamed_required_parallel_calls_accumulate(client: openai.OpenAI, seed: int) -> None:
    """``required`` with parallel calls, streamed: the ``openai`` stream helper's
    accumulation (by position) and a plain one by ``index`` give the non-streamed
    calls, each call's arguments one JSON value (issue 41)."""
    body: dict = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris and the time in Tokyo?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=True,
        max_tokens=[60, 120, 90][seed % 3],
        temperature=1.0,
        seed=seed,
    )
    with client.chat.completions.stream(**body) as stream:
        by_index: dict[int, list[str]] = {}
        for event in stream:
            if event.type != "chunk" or not event.chunk.choices:
                continue
            for tc in event.chunk.choices[0].delta.tool_calls or []:
                entry = by_index.setdefault(tc.index, ["", ""])
                entry[0] += (tc.function.name or "") if tc.function else ""
                entry[1] += (tc.function.arguments or "") if tc.function else ""
        final = stream.get_final_completion()
    helper = [(t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls]
    assert helper == [tuple(by_index[k]) for k in sorted(by_index)]
    for name, arguments in helper:
        check_call(name, arguments)
    full = client.chat.completions.create(**body)
    assert helper == [
        (t.function.name, t.function.arguments) for t in full.choices[0].message.tool_calls
    ]


def test_auto_with_hermes_parser_and_history(client: openai.OpenAI) -> None:
    """The model decides; whatever it wrote is returned as calls (valid JSON) or text,
    streamed and not alike; then a tool result in the history is answered in text."""
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0)
    full = client.chat.completions.create(**kwargs)
    msg = full.choices[0].message
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    if msg.tool_calls:
        assert full.choices[0].finish_reason == "tool_calls"
        for call in msg.tool_calls:
            json.loads(call.function.arguments)
        assert [tc.function.name for tc in calls if tc.function.name] == [
            t.function.name for t in msg.tool_calls
        ]
        assert "<tool_call>" not in (msg.content or "") + streamed
    else:
        assert streamed == msg.content and not calls

    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=30,
        temperature=0,
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # the tool result reached the prompt
    tok = httpx.post(
        str(client.base_url).removesuffix("/v1/") + "/tokenize",
        json={"messages": history},
    ).json()
    assert tok["count"] > 40


def test_refusals(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
            max_tokens=5,
        )
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\]"):
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[{"type": "function"}], max_tokens=5
        )
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            response_format={"type": "json_object"},
            max_tokens=5,
        )


EMAIL = {
    "type": "function",
    "function": {
        "name": "send_email",
        "description": "Send an email",
        "parameters": {
            "type": "object",
            "properties": {
                "to": {"type": "string"},
                "subject": {"type": "string"},
                "body": {"type": "string"},
            },
            "required": ["to", "subject", "body"],
        },
    },
}
RUNAWAY = [
    {
        "role": "user",
        "content": "Email alice@example.com the complete text of War and Peace, every chapter",
    }
]


def test_forced_call_closes_within_a_tiny_budget(client: openai.OpenAI) -> None:
    """A runaway-inducing prompt at budgets down to the smallest accepted: the call
    still parses and validates, never past max_tokens, streamed and not; below the
    smallest, a 400 saying how large max_tokens must be."""
    named = {"type": "function", "function": {"name": "send_email"}}
    kwargs = dict(model=MODEL, messages=RUNAWAY, tools=[EMAIL], tool_choice=named, seed=3)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kwargs, max_tokens=2)
    body = e.value.body
    assert isinstance(body, dict) and body.get("param") == "max_tokens"
    least = int(str(body["message"]).split("max_tokens >= ")[1].split(",")[0])
    assert 5 < least < 30
    schema = EMAIL["function"]["parameters"]
    for max_tokens in (least, least + 3, 40):
        r = client.chat.completions.create(**kwargs, max_tokens=max_tokens, temperature=1.0)
        c = r.choices[0]
        (call,) = c.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert r.usage.completion_tokens <= max_tokens
        # all of the budget used = closed on it ("length"); else the model ended it
        closed = r.usage.completion_tokens == max_tokens
        assert c.finish_reason == ("length" if closed else "tool_calls")
        chunks = list(
            client.chat.completions.create(
                **kwargs, max_tokens=max_tokens, temperature=1.0, stream=True
            )
        )
        first = chunks[0].choices[0].delta
        assert first.role == "assistant" and first.content is None and first.tool_calls
        arguments = "".join(
            tc.function.arguments or ""
            for ch in chunks
            if ch.choices
            for tc in ch.choices[0].delta.tool_calls or []
        )
        jsonschema.validate(json.loads(arguments), schema)
        assert chunks[-1].choices[0].finish_reason in ("length", "tool_calls")
    # required with parallel calls: the repeated calls end when the budget closes them
    r = client.chat.completions.create(
        model=MODEL, messages=RUNAWAY, tools=[EMAIL], tool_choice="required", max_tokens=60
    )
    assert r.choices[0].message.tool_calls and r.usage.completion_tokens <= 60
    for call in r.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schema)
