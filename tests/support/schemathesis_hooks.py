"""A schemathesis check for ``tests/entrypoints/test_openapi.py`` (loaded through
``SCHEMATHESIS_HOOKS``): ``positive_data_acceptance`` narrowed to the rules JSON Schema
can state. A schema-valid request refused with 400 passes only when the error names
one of the rules below (by ``param`` and ``code``); every other refusal fails."""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

# (param's first part, error code): rules between fields, or on the content of a
# grammar / regex / JSON schema, that a JSON schema cannot state.
CROSS_FIELD_RULES = [
    ("prompt", "context_length_exceeded"),
    ("messages", "context_length_exceeded"),
    ("max_tokens", "context_length_exceeded"),
    ("max_completion_tokens", "context_length_exceeded"),
    ("max_output_tokens", "context_length_exceeded"),  # /v1/responses' name
    ("best_of", "invalid_value"),  # best_of >= n
    ("min_tokens", "invalid_value"),  # min_tokens <= max_tokens
    ("structured_outputs", "invalid_value"),
    ("guided_json", "invalid_value"),  # vLLM's older names of structured_outputs
    ("guided_regex", "invalid_value"),
    ("guided_choice", "invalid_value"),
    ("guided_grammar", "invalid_value"),
    ("response_format", "invalid_value"),
    # function calling: a named tool_choice must be one of tools, "auto" needs the
    # server's --enable-auto-tool-choice, tool names must be distinct, and forced
    # choice excludes response_format (chat/tools.py)
    ("tool_choice", "invalid_value"),
    ("tools", "invalid_value"),
    # /v1/responses items: shapes the item schema's anyOf lets through (e.g. a
    # message with both "type": "function_call" and a role)
    ("input", "invalid_value"),
    # a template variable holding a special-token string (data, never control tokens)
    ("chat_template_kwargs", "invalid_value"),
]


def cross_field_refusal(status_code: int, content: bytes) -> bool:
    if status_code != 400:
        return False
    try:
        error = json.loads(content)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    param = error.get("param") or ""
    return any(
        param.split(".")[0] == prefix and error.get("code") == code
        for prefix, code in CROSS_FIELD_RULES
    )


@schemathesis.check
def positive_data_acceptance_beyond_json_schema(ctx: Any, response: Any, case: Any) -> bool | None:
    """``positive_data_acceptance``, except refusals for the rules JSON Schema cannot state."""
    if cross_field_refusal(response.status_code, response.content):
        return None
    return positive_data_acceptance(ctx, response, case)
