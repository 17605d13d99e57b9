"""The structured-output parts of an OpenAI request: OpenAI's ``response_format``
(``text``, ``json_object``, ``json_schema``) and vLLM's ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``), as strict pydantic
models, and their mapping onto :class:`StructuredOutputsParams`. Whether a schema,
regex or grammar compiles is the engine's check (``GrammarCompiler``), answered 400
naming the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.entrypoints.openai_errors import bad_request, request_error_to_api
from kvserve.request import RequestError
from kvserve.structured.params import StructuredOutputsParams

# Engine field -> request field when the constraint came from response_format.
RESPONSE_FORMAT_NAMES = {
    "structured_outputs": "response_format",
    "structured_outputs.json": "response_format.json_schema.schema",
    "structured_outputs.json_object": "response_format",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any
    JSON object) or ``json_schema`` (an object valid against ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these."""

    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {"required": ["json"], "properties": {"json": {"type": ["object", "string"]}}},
                {"required": ["regex"], "properties": {"regex": {"type": "string"}}},
                {"required": ["choice"], "properties": {"choice": {"type": "array"}}},
                {"required": ["grammar"], "properties": {"grammar": {"type": "string"}}},
                {"required": ["json_object"], "properties": {"json_object": {"const": True}}},
            ]
        },
    )

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, json_schema_extra={"minLength": 1})
    choice: list[str] | None = Field(
        default=None,
        json_schema_extra={"minItems": 1, "items": {"type": "string", "minLength": 1}},
    )
    grammar: str | None = Field(default=None, json_schema_extra={"minLength": 1})
    json_object: bool | None = None


def structured_params(
    so: StructuredOutputsRequest | None, rf: ResponseFormat | None
) -> StructuredOutputsParams | None:
    """``structured_outputs`` or ``response_format`` as engine params (None for none or
    ``{"type": "text"}``); APIError(400) naming the field when both are set or the
    shape is wrong."""
    if so is not None and rf is not None and rf.type != "text":
        raise bad_request(
            "send either response_format or structured_outputs, not both",
            param="structured_outputs",
        )
    try:
        if so is not None:
            return StructuredOutputsParams(
                json=so.json_,
                regex=so.regex,
                choice=tuple(so.choice) if so.choice is not None else None,
                grammar=so.grammar,
                json_object=bool(so.json_object),
            )
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request(
                'response_format of type "json_schema" needs json_schema.schema; for example '
                '{"type": "json_schema", "json_schema": {"name": "person", "schema": '
                '{"type": "object"}}}',
                param="response_format.json_schema.schema",
            )
        return StructuredOutputsParams(json=rf.json_schema.schema_)
    except RequestError as e:
        names = RESPONSE_FORMAT_NAMES if so is None else {}
        raise request_error_to_api(e, names) from None
