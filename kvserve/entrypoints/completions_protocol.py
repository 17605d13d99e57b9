"""POST /v1/completions' request model: the prompt forms it accepts and the rules
between its fields (``echo``, ``best_of``, ``max_tokens: 0``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

from kvserve.entrypoints.openai_errors import EXAMPLES, bad_request, short_repr
from kvserve.entrypoints.openai_protocol import (
    MAX_LOGPROBS,
    SamplingRequest,
    sampling_model_config,
    schema_present,
)

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    ]
}


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    model_config = sampling_model_config(
        {
            "if": schema_present("max_tokens", {"const": 0}),
            "then": schema_present("echo", {"const": True}),
        }
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
