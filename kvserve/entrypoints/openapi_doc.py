"""The server's ``/openapi.json``: every route's request body (the pydantic request
models of ``chat_protocol``, ``completions_protocol`` and ``responses_protocol``)
and its responses (200, 400, 401, 404, 503), with schemas that the server's answers match.

The routes parse their bodies themselves (strict types, errors in OpenAI's shape), so
FastAPI sees no body parameters; this module writes the document instead:

    request bodies   CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                     DetokenizeRequest (``model_json_schema``), with the engine's own
                     limits filled in (token ids below the vocabulary size)
    200              the response shape (JSON; ``text/event-stream`` too for the
                     streaming routes)
    400/401/404/503  OpenAI's error body ``{"error": {message, type, param, code}}``

Rules a request follows that a JSON schema cannot state (prompt + max_tokens within
``max_model_len``, ``best_of >= n``, ``max_tokens: 0`` only with ``echo``,
``top_logprobs`` only with ``logprobs``, ``stream_options`` only with ``stream``, a
schema or grammar that compiles) are in the operation descriptions and answered 400.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvserve.entrypoints.chat.template import RESERVED_NAMES
from kvserve.entrypoints.chat_protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.entrypoints.completions_protocol import CompletionRequest
from kvserve.entrypoints.responses_protocol import ResponsesRequest
from kvserve.entrypoints.server_http import OPEN_PATHS
from kvserve.request import MAX_SAMPLES

REF = "#/components/schemas/{model}"

_NULLABLE_STR = {"type": ["string", "null"]}
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_STR,
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
    },
}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "abort", None]}
_COMPLETION_CHOICE = {
    "type": "object",
    "required": ["index", "text", "logprobs", "finish_reason"],
    "properties": {
        "index": {"type": "integer", "minimum": 0},
        "text": {"type": "string"},
        "logprobs": {
            "type": ["object", "null"],
            "properties": {
                "tokens": {"type": "array", "items": {"type": "string"}},
                "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
                "top_logprobs": {"type": "array", "items": {"type": ["object", "null"]}},
                "text_offset": {"type": "array", "items": {"type": "integer"}},
            },
        },
        "finish_reason": _FINISH,
        "prompt_logprobs": {"type": "array", "items": {"type": ["object", "null"]}},
    },
}
_CHAT_CHOICE = {
    "type": "object",
    "required": ["index", "message", "finish_reason"],
    "properties": {
        "index": {"type": "integer", "minimum": 0},
        "message": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": _NULLABLE_STR},
        },
        "logprobs": {"type": ["object", "null"]},
        "finish_reason": _FINISH,
    },
}


def _envelope(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        },
    }


_MODELS_LIST = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "object"],
                "properties": {"id": {"type": "string"}, "object": {"const": "model"}},
            },
        },
    },
}
_TOKENIZE = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens"],
    "properties": {
        "count": {"type": "integer"},
        "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"type": ["array", "null"]},
    },
}
_DETOKENIZE = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}
# One Server-Sent Event: ``data:`` is a JSON chunk of the response, an error body, or
# ``[DONE]``.
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
        }
    }
}


_RESPONSE: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "status", "output"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "status": {"enum": ["completed", "incomplete"]},
        "output": {"type": "array", "items": {"type": "object"}},
    },
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": _json({"$ref": REF.format(model="Error")})}


_ERRORS = {
    "400": _error("Bad request: the message says what to change and `param` names the field"),
    "401": _error("Missing or wrong API key (when the server has one)"),
    "404": _error("Unknown model"),
    "413": _error("The body is larger than the server's --max-request-body-bytes"),
    "415": _error("The body is not JSON (send Content-Type: application/json)"),
    "503": _error("Overloaded (`Retry-After`) or shutting down"),
}


def _post(
    summary: str, model: type[BaseModel], ok: dict[str, Any], *, streams: bool
) -> dict[str, Any]:
    content = dict(_json(ok))
    if streams:
        content.update(_SSE)
    return {
        "post": {
            "summary": summary,
            "description": (model.__doc__ or "").strip() + "\n\n" + (__doc__ or ""),
            "requestBody": {
                "required": True,
                "content": _json({"$ref": REF.format(model=model.__name__)}),
            },
            "responses": {
                "200": {"description": "OK", "content": content},
                **copy.deepcopy(_ERRORS),
            },
        }
    }


def _get(summary: str, ok: dict[str, Any] | None, codes: tuple[str, ...]) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK"}}
    if ok is not None:
        responses["200"]["content"] = ok
    for code in codes:
        responses[code] = copy.deepcopy(_ERRORS[code])
    return {"get": {"summary": summary, "responses": responses}}


def openapi_document(
    *,
    vocab_size: int,
    max_model_len: int,
    max_num_seqs: int | None = None,
    api_key_required: bool = False,
    trust_request_chat_template: bool = False,
    title: str = "kvserve",
    version: str = "0.1.0",
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server (see the module docstring): token ids
    below ``vocab_size``; ``max_tokens``/``max_completion_tokens``/``max_output_tokens`` at most
    ``max_model_len - 1`` (a prompt has at least one token); ``n``/``best_of`` at
    most ``MAX_SAMPLES``, the limit ``SamplingParams`` enforces, and at most
    ``max_num_seqs`` when given (a request's samples run together); the bearer security
    scheme, applied to the ``/v1``, ``/tokenize`` and ``/detokenize`` operations,
    only when ``api_key_required``; a request ``chat_template`` (top level or in
    ``chat_template_kwargs``) only when ``trust_request_chat_template``."""
    models: list[type[BaseModel]] = [
        CompletionRequest,
        ChatCompletionRequest,
        TokenizeRequest,
        DetokenizeRequest,
        ResponsesRequest,
    ]
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    _limit_token_ids(schemas, vocab_size)
    for name, field in (
        ("CompletionRequest", "n"),
        ("CompletionRequest", "best_of"),
        ("ChatCompletionRequest", "n"),
    ):
        samples = MAX_SAMPLES if max_num_seqs is None else min(MAX_SAMPLES, max_num_seqs)
        schemas[name]["properties"][field]["maximum"] = samples
    for name, field in (
        ("CompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_completion_tokens"),
        ("ResponsesRequest", "max_output_tokens"),
    ):
        schemas[name]["properties"][field]["maximum"] = max(max_model_len - 1, 1)
    for name in ("ChatCompletionRequest", "TokenizeRequest"):
        _chat_template_fields(schemas[name]["properties"], trust_request_chat_template)
    schemas["Error"] = _ERROR
    paths = {
        "/v1/completions": _post(
            "Completions",
            CompletionRequest,
            _envelope("text_completion", _COMPLETION_CHOICE),
            streams=True,
        ),
        "/v1/chat/completions": _post(
            "Chat completions",
            ChatCompletionRequest,
            _envelope("chat.completion", _CHAT_CHOICE),
            streams=True,
        ),
        "/v1/responses": _post(
            "Responses (OpenAI's Responses API, served as a chat completion)",
            ResponsesRequest,
            _RESPONSE,
            streams=True,
        ),
        "/tokenize": _post("Tokenize", TokenizeRequest, _TOKENIZE, streams=False),
        "/detokenize": _post("Detokenize", DetokenizeRequest, _DETOKENIZE, streams=False),
        "/v1/models": _get("The served model", _json(_MODELS_LIST), ("401",)),
        "/v1/models/{model_id}": {
            "get": {
                **_get("One model by id", _json({"type": "object"}), ("401", "404"))["get"],
                "parameters": [
                    {
                        "name": "model_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                    }
                ],
            }
        },
        "/health": _get("200 while the engine runs", None, ("503",)),
        "/metrics": _get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}, ()),
        "/version": _get(
            "Server version",
            _json({"type": "object", "properties": {"version": {"type": "string"}}}),
            (),
        ),
    }
    components: dict[str, Any] = {"schemas": schemas}
    if api_key_required:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path not in OPEN_PATHS:
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": components,
    }


def _chat_template_fields(props: dict[str, Any], trusted: bool) -> None:
    """``chat_template_kwargs`` keys are names that do not shadow the template's own
    variables; ``chat_template`` (field or key) only on a trusting server."""
    reserved = sorted(RESERVED_NAMES - ({"chat_template"} if trusted else set()))
    if not trusted:
        props.pop("chat_template", None)
    kwargs = props.get("chat_template_kwargs")
    if kwargs is not None:
        kwargs.clear()
        kwargs.update(
            {
                "type": ["object", "null"],
                "propertyNames": {
                    "pattern": "^[A-Za-z_][A-Za-z0-9_]*$",
                    "not": {"enum": reserved},
                },
            }
        )


def _limit_token_ids(schemas: dict[str, Any], vocab_size: int) -> None:
    """Token ids in prompts, ``tokens`` and ``logit_bias`` keys: below ``vocab_size``."""
    for name, field in (("CompletionRequest", "prompt"), ("DetokenizeRequest", "tokens")):
        _set_token_max(schemas.get(name, {}).get("properties", {}).get(field), vocab_size - 1)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        allowed = schemas.get(name, {}).get("properties", {}).get("allowed_token_ids")
        _set_token_max(allowed, vocab_size - 1)
        # the server checks stop ids against the vocabulary too (400 otherwise)
        stop = schemas.get(name, {}).get("properties", {}).get("stop_token_ids")
        _set_token_range(stop, vocab_size - 1)
    pattern = f"^({_below_regex(vocab_size)})$"
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        bias = schemas.get(name, {}).get("properties", {}).get("logit_bias")
        if bias is not None:
            bias["propertyNames"] = {"pattern": pattern}


def _set_token_max(node: Any, maximum: int) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0 and "maximum" not in node:
            node["maximum"] = maximum
        for value in node.values():
            _set_token_max(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _set_token_max(value, maximum)


def _set_token_range(node: Any, maximum: int) -> None:
    """Every integer in ``node``: 0..``maximum``."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["minimum"], node["maximum"] = 0, maximum
        for value in node.values():
            _set_token_range(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _set_token_range(value, maximum)


def _below_regex(n: int) -> str:
    """A regex matching the decimal numbers 0..n-1 (n >= 1) without leading zeros."""
    top = str(n - 1)
    parts = ["0"]
    for length in range(1, len(top)):  # every number with fewer digits than n - 1
        parts.append("[1-9]" + "[0-9]" * (length - 1))
    for i, digit in enumerate(top):  # as many digits: below n - 1 from position i on
        lo, d = (1 if i == 0 else 0), int(digit)
        if d - 1 >= lo:
            parts.append(top[:i] + f"[{lo}-{d - 1}]" + "[0-9]" * (len(top) - i - 1))
    parts.append(top)
    return "|".join(dict.fromkeys(parts))
