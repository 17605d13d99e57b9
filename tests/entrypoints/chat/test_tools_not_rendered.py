"""Tools are never dropped silently (issue 43 item 6): with a chat template that has
no tools section, a request with ``tools`` and ``tool_choice: "auto"`` is refused
(400 naming --chat-template) instead of rendering the same prompt as one without."""

from __future__ import annotations

from typing import Any

import pytest
from support.tool_defs import TEMPLATE

from kvserve.entrypoints.chat.prompt import ChatPromptBuilder, ChatPromptError
from kvserve.entrypoints.chat.template import load_chat_template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvserve.model.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def test_model_template_without_tools_refuses_auto(tokenizer: Any) -> None:
    builder = ChatPromptBuilder(tokenizer)
    assert not builder.renders_tools()
    # what happened before: the same prompt with and without tools
    with_tools = builder.build(MESSAGES, tools=TOOLS)
    assert with_tools.token_ids == builder.build(MESSAGES).token_ids
    with pytest.raises(ChatPromptError) as e:
        builder.build(MESSAGES, tools=TOOLS, tools_must_render=True)
    assert e.value.param == "tools" and "--chat-template" in str(e.value)


def test_tool_template_renders_tools(tokenizer: Any) -> None:
    builder = ChatPromptBuilder(tokenizer, template=load_chat_template(str(TEMPLATE)))
    assert builder.renders_tools()
    prompt = builder.build(MESSAGES, tools=TOOLS, tools_must_render=True)
    assert "get_weather" in prompt.text
