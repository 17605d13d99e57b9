"""The OpenAI request fields shared by completions and chat, and their mapping onto
:class:`SamplingParams` (:class:`SamplingRequest`); the endpoint models live in
``completions_protocol`` (POST /v1/completions) and ``chat_protocol`` (chat,
tokenize, detokenize).

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

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from kvserve.entrypoints.openai_errors import EXAMPLES, bad_request, request_error_to_api
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
_STOP_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}},
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


class StrictModel(BaseModel):
    """Strict JSON types (no coercion); unknown fields allowed and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


def schema_present(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """JSON-schema clause: field ``name`` is sent and matches ``schema``."""
    return {"required": [name], "properties": {name: schema}}


# Rules between fields, stated in the JSON schema as if/then (the checks below
# enforce them with a message).
STREAM_OPTIONS_RULE: Any = {
    "if": schema_present("stream_options", {"type": "object"}),
    "then": schema_present("stream", {"const": True}),
}


def sampling_model_config(rule: dict[str, Any]) -> ConfigDict:
    """An endpoint model's config: strict, extras ignored, and its JSON schema stating
    the stream_options rule and ``rule`` (if/then clauses the checks enforce)."""
    return ConfigDict(
        extra="allow", strict=True, json_schema_extra={"allOf": [STREAM_OPTIONS_RULE, rule]}
    )


class SamplingRequest(StrictModel):
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
