"""POST /v1/chat/completions on :class:`OpenAIServing`: the chat prompt rendered
on a worker thread (template, tools), tool-choice constraints, one engine request
per sample. ``render_chat`` also serves /tokenize and /v1/responses."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from kvserve.entrypoints.chat.prompt import ChatPrompt, ChatPromptError, TemplateError
from kvserve.entrypoints.chat.render_pool import RenderBusyError
from kvserve.entrypoints.chat.template import TemplateTimeoutError
from kvserve.entrypoints.chat.tools import TOOL_PARAM_NAMES, ToolOutput, plan_tools
from kvserve.entrypoints.chat_protocol import ChatCompletionRequest
from kvserve.entrypoints.openai_errors import bad_request
from kvserve.entrypoints.openai_render import ChatRenderer
from kvserve.entrypoints.openai_serving import Generation, OpenAIServing, include_usage
from kvserve.entrypoints.serving_streams import retry_later


# ------------------------------------------------------------------ chat
async def render_chat(
    serving: OpenAIServing,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools_must_render: bool = False,
) -> ChatPrompt:
    """The chat prompt (``ChatPromptBuilder.build`` on a worker thread); its
    refusals as APIError: 400 (template refused, too slow, not allowed), 503 when
    every render worker is busy."""
    try:
        return await serving.chat_threads.run(
            serving.chat.build,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools_must_render=tools_must_render,
        )
    except ChatPromptError as e:
        raise bad_request(str(e), param=e.param, code=e.code) from None
    except RenderBusyError as e:
        raise retry_later(503, str(e), "chat_template_busy") from None
    except TemplateTimeoutError as e:
        raise bad_request(str(e), param="messages", code="chat_template_timeout") from None
    except TemplateError as e:
        raise bad_request(str(e), param="messages", code="chat_template_error") from None


async def start_chat(serving: OpenAIServing, req: ChatCompletionRequest) -> Generation:
    """Validate and queue the conversation."""
    lora_name = serving.check_model(req.model)
    req.check()
    plan = plan_tools(
        req.tools,
        req.tool_choice,
        req.parallel_tool_calls,
        tool_parser=serving.tool_parser,
        auto_enabled=serving.enable_auto_tool_choice,
    )
    prompt = await render_chat(
        serving,
        [m.as_template_dict() for m in req.messages],
        tools=plan.template_tools,
        add_generation_prompt=req.add_generation_prompt,
        chat_template=req.chat_template,
        chat_template_kwargs=req.chat_template_kwargs,
        tools_must_render=plan.mode == "auto",
    )
    text, ids = prompt.text, prompt.token_ids
    max_tokens, max_param = req.requested_max_tokens
    params = req.sampling_params(
        max_tokens,
        req.num_logprobs,
        max_tokens_param=max_param,
        defaults=serving.sampling_defaults,
    )
    params = serving.seeds.fill(params)
    req_id = f"chatcmpl-{uuid.uuid4().hex}"
    names = req.param_names(max_param)
    forced = plan.structured()
    if forced is not None:
        if params.structured_outputs is not None:
            raise bad_request(
                f"tool_choice {plan.mode!r} constrains the output to tool calls, so it "
                "cannot be combined with response_format or structured_outputs: drop one",
                param="tool_choice",
            )
        params = dataclasses.replace(params, structured_outputs=forced)
        names = {**names, **TOOL_PARAM_NAMES}
    streams = await serving.submit(req_id, [(text, ids, params)], req.cache_salt, names, lora_name)
    renderer = ChatRenderer(
        req, serving.token_texts, ids, ToolOutput(plan, len(streams), max_tokens)
    )
    return Generation(
        req_id,
        streams,
        renderer,
        include_usage(req),
        [0] * len(streams),
        n=params.n,
        model=lora_name,
    )
