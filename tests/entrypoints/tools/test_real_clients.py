"""Agent-shaped clients against kvserve: LangChain ``bind_tools`` and a two-step
tool loop, LiteLLM tools, the OpenAI Agents SDK over ``/v1/responses`` and over
chat completions, and the Responses API through the ``openai`` client
(function_call_output items, streaming events)."""

from __future__ import annotations

import json

import openai
import pytest
from support.tool_defs import MODEL, WEATHER

pytestmark = pytest.mark.model
QUESTION = "What is the weather in Paris?"


def test_langchain_bind_tools_two_step_loop(tool_server: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calls: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"18 C and sunny in {city}"

    llm = ChatOpenAI(
        base_url=tool_server + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=60
    )
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    ai = forced.invoke([HumanMessage(QUESTION)])
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"]
    call = ai.tool_calls[0]
    assert isinstance(call["args"].get("city"), str)
    result = get_weather.invoke(call["args"])
    # step two: the tool result goes back; auto tool choice (hermes parser) answers
    final = llm.bind_tools([get_weather]).invoke(
        [HumanMessage(QUESTION), ai, ToolMessage(result, tool_call_id=call["id"])]
    )
    assert final.content or final.tool_calls
    assert calls == [call["args"]["city"]]


def test_litellm_tools(tool_server: str) -> None:
    import litellm

    resp = litellm.completion(
        model="openai/" + MODEL,
        api_base=tool_server + "/v1",
        api_key="unused",
        messages=[{"role": "user", "content": QUESTION}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=60,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_sdk(tool_server: str, api: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=tool_server + "/v1", api_key="unused", max_retries=0)
    model = (
        OpenAIResponsesModel(model=MODEL, openai_client=client)
        if api == "responses"
        else OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    )
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"18 C and sunny in {city}"

    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather using the tools.",
        tools=[get_weather],
        model=model,
        # one call: with parallel calls allowed the 135M model repeats the same call
        # until max_tokens (the grammar lets it; see docs/function-calling.md)
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, QUESTION, max_turns=2)
    assert len(seen) == 1
    assert result.final_output == f"18 C and sunny in {seen[0]}"


def test_responses_api_items_and_stream(tool_server: str) -> None:
    client = openai.OpenAI(base_url=tool_server + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", **WEATHER["function"]}]
    forced = client.responses.create(
        model=MODEL,
        instructions="Use the tools.",
        input=QUESTION,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    assert forced.status == "completed"
    (call,) = [o for o in forced.output if o.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    assert forced.usage is not None and forced.usage.output_tokens > 0

    history = [
        {"role": "user", "content": QUESTION},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
    ]
    answer = client.responses.create(
        model=MODEL,
        input=history,
        tools=tools,
        tool_choice="none",
        max_output_tokens=20,
        temperature=0,
    )
    assert answer.output_text

    events = list(
        client.responses.create(
            model=MODEL,
            input=history,
            tools=tools,
            tool_choice="none",
            max_output_tokens=20,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == answer.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")


def test_responses_budget_refusal_names_max_output_tokens(tool_server: str) -> None:
    client = openai.OpenAI(base_url=tool_server + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL,
            input=QUESTION,
            tools=[{"type": "function", **WEATHER["function"]}],
            tool_choice="required",
            max_output_tokens=2,
        )
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "max_output_tokens"
    assert "max_output_tokens >= " in body["message"] and "max_completion" not in body["message"]
