"""OpenAI-shaped errors of the server: :class:`APIError` (status, ``{"error": {message,
type, param, code}}`` body), and the mapping of pydantic validation errors and engine
:class:`RequestError` refusals onto 400s that name the request's own field, the rule
and a valid example."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from kvserve.request import RequestError


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # A message or param may quote client text: lone surrogates in it are escaped
        # (``\\ud800``) so that the body can always be encoded as UTF-8.
        message = _encodable(message)
        param = _encodable(param) if param is not None else None
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# Valid examples shown in messages about a field.
EXAMPLES: dict[str, str] = {
    "model": '"model": "smollm2-135m-instruct"',
    "prompt": '"prompt": "Once upon a time" (or a list of token ids such as [1, 2, 3])',
    "messages": '"messages": [{"role": "user", "content": "Hello"}]',
    "max_tokens": '"max_tokens": 16',
    "max_completion_tokens": '"max_completion_tokens": 16',
    "temperature": '"temperature": 0.7',
    "top_p": '"top_p": 0.9',
    "top_k": '"top_k": 40',
    "min_p": '"min_p": 0.05',
    "seed": '"seed": 42',
    "stop": '"stop": ["\\n"]',
    "n": '"n": 1',
    "logprobs": '"logprobs": 2',
    "top_logprobs": '"top_logprobs": 2',
    "stream": '"stream": true',
    "stream_options": '"stream_options": {"include_usage": true}',
    "cache_salt": '"cache_salt": "tenant-a"',
    "stop_token_ids": '"stop_token_ids": [2]',
    "ignore_eos": '"ignore_eos": true',
    "min_tokens": '"min_tokens": 4',
    "presence_penalty": '"presence_penalty": 0.5',
    "frequency_penalty": '"frequency_penalty": 0.5',
    "repetition_penalty": '"repetition_penalty": 1.1',
    "tokens": '"tokens": [1, 2, 3]',
    "best_of": '"best_of": 2',
    "logit_bias": '"logit_bias": {"50256": -100}',
    "prompt_logprobs": '"prompt_logprobs": 1',
    "response_format": '"response_format": {"type": "json_object"}',
    "structured_outputs": '"structured_outputs": {"choice": ["yes", "no"]}',
    "echo": '"echo": true',
}


def example_for(param: str | None) -> str:
    key = re.split(r"[.\[]", param)[0] if param else ""
    return EXAMPLES.get(key, "")


def validation_error_to_api(err: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field, the rule and an example."""
    first = err.errors(include_url=False)[0]
    param = _loc_to_param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if first.get("type") == "missing":
        text = f"missing required field '{param}'"
        code = "missing_required_parameter"
    else:
        got = first.get("input")
        text = f"invalid value for '{param}': {msg} (got {short_repr(got)})"
        code = "invalid_type"
    example = example_for(param)
    if example:
        text += f"; for example {example}"
    return bad_request(text, param=param, code=code)


def request_error_to_api(err: RequestError, names: dict[str, str]) -> APIError:
    """A refused request as a 400 naming the request's own field (``names`` maps
    engine names such as ``"prompt"``/``"max_tokens"`` to the request's), with an
    example when there is one."""
    param = names.get(err.param, err.param) if err.param else None
    text = str(err)
    if param != err.param:
        text += f" ({err.param} is this request's {param})"
    example = example_for(param)
    if example and "for example" not in str(err):  # the message's own example wins
        text += f"; for example {example}"
    return bad_request(text, param=param, code=err.code)


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
