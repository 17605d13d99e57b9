"""OpenAI request models for the server, and their mapping onto :class:`SamplingParams`.

The models follow OpenAI's field names plus vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``cache_salt``, ...). They
are *strict*: a field of the wrong JSON type is a 400 (``"max_tokens": "5"`` is not
coerced), and unknown fields are allowed and ignored, as OpenAI's API does.

Every user error becomes :class:`APIError` with OpenAI's body
``{"error": {"message", "type", "param", "code"}}``; the message names the value,
the rule and a valid example.

Defaults that differ between OpenAI and vLLM, and the ones kvserve picks:
- ``max_tokens`` absent: completions use 16 (OpenAI's default) capped to the
  context left; chat uses the whole context left (``max_model_len - prompt``), as
  both OpenAI and vLLM do.
- ``temperature`` absent: 1.0 (OpenAI's default; send 0 for greedy).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from kvserve.entrypoints.openai_errors import (
    EXAMPLES,
    bad_request,
    request_error_to_api,
    short_repr,
)
from kvserve.entrypoints.openai_structured import (
    RESPONSE_FORMAT_NAMES,
    ResponseFormat,
    StructuredOutputsRequest,
    structured_params,
)
from kvserve.request import RequestError, SamplingParams
from kvserve.structured.params import StructuredOutputsParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20


# --------------------------------------------------------------------- JSON schemas
# What the OpenAPI document says the free-form fields accept (the validators below
# enforce the same).
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    ]
}
_STOP_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}},
        {"type": "null"},
    ]
}
_CONTENT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                "required": ["type", "text"],
            },
        },
        {"type": "null"},
    ]
}


_FUNCTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
        "description": {"type": "string"},
        "parameters": {"type": "object", "properties": {"type": {"const": "object"}}},
        "strict": {"type": "boolean"},
    },
}
_TOOLS_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "function"],
                "properties": {"type": {"const": "function"}, "function": _FUNCTION_SCHEMA},
            },
        },
        {"type": "null"},
    ]
}


# --------------------------------------------------------------------- validators
def _check_stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise ValueError("use a string or a list of strings")


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


def _present(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": [name], "properties": {name: schema}}


# Rules between fields, stated in the JSON schema as if/then (the checks below
# enforce them with a message).
_STREAM_OPTIONS_RULE: Any = {
    "if": _present("stream_options", {"type": "object"}),
    "then": _present("stream", {"const": True}),
}


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, json_schema_extra={"minimum": 0})
    temperature: float | None = Field(default=None, json_schema_extra={"minimum": 0})
    top_p: float | None = Field(
        default=None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1}
    )
    top_k: int | None = Field(default=None, json_schema_extra={"minimum": -1})
    min_p: float | None = Field(default=None, json_schema_extra={"minimum": 0, "maximum": 1})
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: Annotated[Any, WithJsonSchema(_STOP_SCHEMA)] = None
    stop_token_ids: list[int] | None = Field(
        default=None, json_schema_extra={"items": {"type": "integer", "minimum": 0}}
    )
    n: int | None = Field(default=None, json_schema_extra={"minimum": 1, "maximum": 128})
    presence_penalty: float | None = Field(
        default=None, json_schema_extra={"minimum": -2, "maximum": 2}
    )
    frequency_penalty: float | None = Field(
        default=None, json_schema_extra={"minimum": -2, "maximum": 2}
    )
    repetition_penalty: float | None = Field(
        default=None, json_schema_extra={"exclusiveMinimum": 0}
    )
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, json_schema_extra={"minimum": 0})
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, json_schema_extra={"minLength": 1})
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(
        default=None,
        json_schema_extra={
            "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,8})$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
    )
    prompt_logprobs: int | None = Field(
        default=None, json_schema_extra={"minimum": 0, "maximum": MAX_LOGPROBS}
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older names of structured_outputs' fields (mapped onto it).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's sampling extensions.
    allowed_token_ids: list[int] | None = Field(
        default=None,
        json_schema_extra={"minItems": 1, "items": {"type": "integer", "minimum": 0}},
    )
    bad_words: list[str] | None = Field(
        default=None, json_schema_extra={"items": {"type": "string", "minLength": 1}}
    )
    truncate_prompt_tokens: int | None = Field(default=None, json_schema_extra={"minimum": 1})

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        return _check_stop(value)

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("use a non-empty string, or leave cache_salt out")
        return value

    def check_common(self) -> None:
        """Refuse what kvserve does not support, with the fix."""
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true: set "
                '"stream": true or remove stream_options',
                param="stream_options",
            )

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        *,
        max_tokens_param: str,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """Build SamplingParams; raise APIError(400) naming the offending field.
        ``defaults`` (the model's generation config) fill sampling fields the
        request leaves out."""
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "stop": self.stop or [],
            "stop_token_ids": self.stop_token_ids or [],
            "logprobs": logprobs,
            "seed": self.seed,
            "prompt_logprobs": self.prompt_logprobs,
            "logit_bias": self.token_logit_bias(),
            "structured_outputs": self.structured(),
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
        }
        for name in (
            "n",
            "best_of",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name, None)
            if value is None and defaults:
                value = defaults.get(name)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except RequestError as e:
            raise request_error_to_api(e, self.param_names(max_tokens_param)) from None

    def param_names(self, max_tokens_param: str) -> dict[str, str]:
        """Engine field name -> this request's field name, for :func:`request_error_to_api`."""
        return {"max_tokens": max_tokens_param, **self._structured_names()}

    def _structured_names(self) -> dict[str, str]:
        legacy = self._legacy_guided()
        if legacy:
            return {f"structured_outputs.{k}": f"guided_{k}" for k in legacy} | {
                "structured_outputs": "guided_" + next(iter(legacy))
            }
        if self.response_format is None or self.structured_outputs is not None:
            return {}
        return dict(RESPONSE_FORMAT_NAMES)

    def _legacy_guided(self) -> dict[str, Any]:
        """The ``guided_*`` fields sent, by structured_outputs name (none when
        ``structured_outputs`` is sent: it wins)."""
        if self.structured_outputs is not None:
            return {}
        values = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        return {k: v for k, v in values.items() if v is not None}

    def token_logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids; 400 naming it for a key that is not one."""
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            if not re.fullmatch(r"0|[1-9][0-9]{0,8}", key):
                raise bad_request(
                    f"logit_bias key {key!r} is not a token id: keys are token ids as strings; "
                    "for example " + EXAMPLES["logit_bias"],
                    param="logit_bias",
                )
            out[int(key)] = bias
        return out

    def structured(self) -> StructuredOutputsParams | None:
        """``structured_outputs`` or ``response_format`` as engine params (see
        :func:`structured_params`); 400 naming the request's field."""
        legacy = self._legacy_guided()
        if legacy:
            kind, value = next(iter(legacy.items()))
            so = StructuredOutputsRequest.model_validate({kind: value})
            return structured_params(so, self.response_format)
        return structured_params(self.structured_outputs, self.response_format)

    def unused_fields(self) -> list[str]:
        """Fields that were sent but lost to another: guided_* beside
        structured_outputs, and every guided_* after the first (json, regex,
        choice, grammar order); named in the ignored-fields header."""
        sent = [
            name
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(self, name) is not None
        ]
        return sent if self.structured_outputs is not None else sent[1:]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={
            "allOf": [
                _STREAM_OPTIONS_RULE,
                {
                    "if": _present("max_tokens", {"const": 0}),
                    "then": _present("echo", {"const": True}),
                },
            ]
        },
    )

    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]
    logprobs: int | None = Field(
        default=None, json_schema_extra={"minimum": 0, "maximum": MAX_LOGPROBS}
    )
    echo: bool = False
    suffix: str | None = Field(default=None, json_schema_extra={"maxLength": 0})
    best_of: int | None = Field(default=None, json_schema_extra={"minimum": 1, "maximum": 128})

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list (one element per completion to generate).

        Accepts a string, a list of strings, a list of token ids, or a list of lists
        of token ids; raises APIError(400) for anything else or an empty prompt list.
        """
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if _is_token_list(p):
                return [list(p)]
            if all(isinstance(x, str) for x in p):
                return list(p)
            if all(_is_token_list(x) for x in p):
                return [list(x) for x in p]
        if isinstance(p, list) and not p:
            raise bad_request(
                "prompt is an empty list: send at least one prompt; for example "
                + EXAMPLES["prompt"],
                param="prompt",
            )
        raise bad_request(
            f"invalid value for 'prompt' (got {short_repr(p)}): use a string, a list of strings, "
            "a list of token ids (integers) or a list of such lists; for example "
            + EXAMPLES["prompt"],
            param="prompt",
            code="invalid_type",
        )

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise bad_request("suffix is not supported by this server: remove it", param="suffix")
        n = self.n or 1
        if self.best_of is not None and self.best_of < n:
            raise bad_request(
                f"best_of={self.best_of} is less than n={n}: best_of samples are generated "
                "and the n best returned, so use best_of >= n",
                param="best_of",
            )
        if self.stream and self.best_of is not None and self.best_of > n:
            raise bad_request(
                f"best_of={self.best_of} > n={n} cannot be streamed (the best samples are "
                "known only at the end): set stream to false or best_of to n",
                param="best_of",
            )
        if self.max_tokens == 0 and not self.echo:
            raise bad_request(
                "invalid value for 'max_tokens': 0 is allowed only with \"echo\": true (to "
                "score the prompt); otherwise use a positive integer, for example "
                + EXAMPLES["max_tokens"],
                param="max_tokens",
            )

    @property
    def echo_only(self) -> bool:
        """``max_tokens: 0`` with ``echo``: return the prompt (and its logprobs) only."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Prompt logprobs to compute: ``prompt_logprobs``, or ``logprobs`` with echo."""
        wanted = [
            k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None
        ]
        return max(wanted) if wanted else None


class ToolCallFunction(_Strict):
    name: str
    arguments: str = "{}"


class AssistantToolCall(_Strict):
    """One entry of an assistant message's ``tool_calls`` in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def as_template_dict(self) -> dict[str, Any]:
        try:
            args: Any = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": args},
        }


def _check_content(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                break
            texts.append(part["text"])
        else:
            return "".join(texts)
    raise ValueError(
        'use a string or a list of {"type": "text", "text": "..."} parts '
        "(images and audio are not supported)"
    )


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Any, WithJsonSchema(_CONTENT_SCHEMA)] = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        return _check_content(value)

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: ``developer`` becomes ``system``;
        an assistant's ``tool_calls`` keep OpenAI's shape with ``arguments`` parsed
        into a dict (templates render it with ``tojson``), a tool message keeps
        its ``tool_call_id``."""
        content = self.content
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.as_template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={
            "allOf": [
                _STREAM_OPTIONS_RULE,
                {
                    "if": _present("top_logprobs", {"type": "integer"}),
                    "then": _present("logprobs", {"const": True}),
                },
            ]
        },
    )

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = Field(default=None, json_schema_extra={"minimum": 1})
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, json_schema_extra={"minimum": 0, "maximum": 20})
    add_generation_prompt: bool = True
    # A request's own template: refused (400) unless --trust-request-chat-template.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[Any, WithJsonSchema(_TOOLS_SCHEMA)] = None
    tool_choice: Annotated[Any, WithJsonSchema({})] = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, list):
            raise ValueError('use a list of {"type": "function", "function": {...}} tools')
        return value

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise bad_request(
                "messages is empty: send at least one message; for example " + EXAMPLES["messages"],
                param="messages",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request(
                'top_logprobs needs "logprobs": true: set logprobs to true or drop top_logprobs',
                param="top_logprobs",
            )
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs={self.top_logprobs} is out of range: use an integer from 0 to "
                f"{MAX_LOGPROBS}; for example " + EXAMPLES["top_logprobs"],
                param="top_logprobs",
            )

    def param_names(self, max_tokens_param: str) -> dict[str, str]:
        return {
            "max_tokens": max_tokens_param,
            "prompt": "messages",
            "logprobs": "top_logprobs",
            **self._structured_names(),
        }

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(max_completion_tokens or max_tokens, the name of the field it came from)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's shape): either ``prompt`` or ``messages``."""

    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {
                    "required": ["prompt"],
                    "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}},
                },
                {
                    "required": ["messages"],
                    "properties": {
                        "messages": {"type": "array", "minItems": 1},
                        "prompt": {"type": "null"},
                    },
                },
            ]
        },
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's shape)."""

    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})
