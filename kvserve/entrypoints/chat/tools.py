"""Function calling on chat completions: the ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` fields, what each choice means, and turning a choice's
output text into OpenAI's ``tool_calls`` (whole or streamed).

    tool_choice   what the model sees           how the output is read
    ----------    -------------------------     -------------------------------------
    "none"        no tools (template gets none)  plain content
    "auto"        tools in the chat template     the --tool-call-parser (hermes, ...):
                  (needs --enable-auto-tool-     calls if the model wrote some, else
                  choice --tool-call-parser)     content
    "required"    tools in the template; the     the grammar's JSON array
                  output is a grammar: a JSON    [{"name", "parameters"}, ...]
                  array of >= 1 calls (exactly   (parameters valid against that
                  1 with parallel_tool_calls     function's schema)
                  false)
    {"type": "function", "function": {"name": N}}
                  tools in the template; the     the whole output is N's arguments
                  output is N's parameters
                  schema

``required`` and named choice are enforced by the engine's grammar engine
(``kvserve.structured``, llguidance), so their arguments always parse and validate
against the function's JSON schema, whatever the model; their constraint has
``within_max_tokens``, so the call also always ends within ``max_tokens`` (near the
end of the budget the engine closes it on the shortest completion it knows, e.g.
ends a runaway string argument; ``kvserve.structured.budget``), and a
``max_tokens`` too small for the shortest valid call is a 400 saying how large it
must be. When a choice made calls and the model stopped, its ``finish_reason`` is
``"tool_calls"``.

Rules for callers: build one :class:`ToolOutput` per response and give it each
choice's deltas in order (:meth:`ToolOutput.chunk_delta`), or the whole text
(:meth:`ToolOutput.message`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.entrypoints.chat.tool_parsers import (
    ExtractedToolCalls,
    ToolCall,
    ToolDelta,
    ToolParser,
    get_tool_parser,
)
from kvserve.entrypoints.chat.tool_parsers.base import new_call_id
from kvserve.entrypoints.chat.tool_parsers.llama3_json import JsonCallSequence
from kvserve.entrypoints.chat.tool_stream import ToolCallStream
from kvserve.entrypoints.openai_errors import bad_request
from kvserve.structured.params import StructuredOutputsParams

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOLS_EXAMPLE = (
    '[{"type": "function", "function": {"name": "get_weather", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]'
)
# Engine field -> request field for a forced tool choice's grammar errors.
TOOL_PARAM_NAMES = {"structured_outputs": "tools", "structured_outputs.json": "tools"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class FunctionDefinition(_Strict):
    name: str = Field(json_schema_extra={"minLength": 1, "pattern": "^[A-Za-z0-9_.-]{1,64}$"})
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


ToolChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass
class ToolPlan:
    """What a request's tool fields mean (see the module docstring)."""

    mode: ToolChoiceMode
    tools: list[ChatTool] = field(default_factory=list)
    named: str | None = None
    parallel: bool = True
    parser: type[ToolParser] | None = None

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them (None with ``none``)."""
        if self.mode == "none" or not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar forcing the output (``required`` / named), else None."""
        if self.mode == "named":
            return StructuredOutputsParams(
                json=self._parameters(self.named or ""), within_max_tokens=True
            )
        if self.mode != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "parameters": closed_parameters(t.function.parameters),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": items[0] if len(items) == 1 else {"anyOf": items},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, within_max_tokens=True)

    def _parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t.function.name == name)
        return closed_parameters(tool.function.parameters)

    def new_parser(self) -> ToolParser | None:
        """A fresh output parser for one choice (None: plain content)."""
        if self.mode == "named":
            return NamedCallParser(self.named or "")
        if self.mode == "required":
            return RequiredCallsParser()
        if self.mode == "auto" and self.parser is not None:
            return self.parser()
        return None


def closed_parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters schema as the forced grammar uses it: every object
    schema in it (nested ones too) that lists ``properties`` but does not say
    whether others are allowed gets ``additionalProperties: false`` (its declared
    properties only, as OpenAI's strict mode). Without it a small model tends to
    invent property after property until ``max_tokens``; whatever the grammar
    allows still validates against the original schema."""
    return _close(dict(schema or EMPTY_PARAMETERS))


def _close(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_close(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {k: _close(v) for k, v in out[key].items()}
    for key in ("items", "anyOf", "oneOf", "allOf", "prefixItems", "additionalProperties"):
        if key in out and not isinstance(out[key], bool):
            out[key] = _close(out[key])
    return out


def plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    *,
    tool_parser: str | None,
    auto_enabled: bool,
) -> ToolPlan:
    """Validate the tool fields of a chat request; APIError(400) naming the field."""
    parsed: list[ChatTool] = []
    for i, raw in enumerate(tools or []):
        try:
            parsed.append(ChatTool.model_validate(raw))
        except Exception as e:  # pydantic ValidationError
            raise bad_request(
                f"tools[{i}] is not a function tool ({_first_error(e)}): send {TOOLS_EXAMPLE}",
                param=f"tools[{i}]",
            ) from None
        params = parsed[-1].function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema of type object, got "
                f"type {params.get('type')!r}; for example {TOOLS_EXAMPLE}",
                param=f"tools[{i}].function.parameters",
            )
    names = [t.function.name for t in parsed]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(
            f"tools names the function {dup!r} twice: give each function a distinct name",
            param="tools",
        )
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    mode: ToolChoiceMode
    named = None
    if tool_choice is None:
        mode = "auto" if parsed else "none"
    elif tool_choice in ("none", "auto", "required"):
        mode = tool_choice
    elif (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        mode, named = "named", tool_choice["function"]["name"]
        if named not in names:
            raise bad_request(
                f"tool_choice names the function {named!r}, which is not in tools "
                f"(tools has {', '.join(map(repr, names)) or 'nothing'}): name one of them",
                param="tool_choice",
            )
    else:
        raise bad_request(
            f'invalid tool_choice {json.dumps(tool_choice)[:200]}: use "none", "auto", '
            '"required" or {"type": "function", "function": {"name": "get_weather"}}',
            param="tool_choice",
        )
    if mode in ("required", "named", "auto") and not parsed and tool_choice is not None:
        raise bad_request(
            f'tool_choice "{tool_choice if isinstance(tool_choice, str) else "function"}" '
            "needs tools: send the functions in tools, for example " + TOOLS_EXAMPLE,
            param="tool_choice",
        )
    parser = None
    if mode == "auto" and parsed:
        if not auto_enabled or tool_parser is None:
            raise bad_request(
                'tool_choice "auto" (the default when tools are sent) needs the server to '
                "read tool calls from the model's text: start it with --enable-auto-tool-choice "
                "--tool-call-parser hermes (see docs/function-calling.md), or send tool_choice "
                '"required" or {"type": "function", "function": {"name": ...}}, which this '
                "server enforces with a grammar",
                param="tool_choice",
            )
        parser = get_tool_parser(tool_parser)
    return ToolPlan(mode=mode, tools=parsed, named=named, parallel=parallel, parser=parser)


def _first_error(e: Exception) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return f"{loc}: {first.get('msg')}"
    return str(e)


# ---------------------------------------------------------------------- forced parsers
class NamedCallParser(ToolParser):
    """Named tool choice: the whole output is the arguments of one call."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function
        self.id = new_call_id()
        self.started = False
        self.held = ""  # the first text, sent after the header (as OpenAI streams)

    def feed(self, delta_text: str) -> list[ToolDelta]:
        if not self.started:
            # the header alone first (arguments ""), its text with the next delta
            self.started = True
            self.held = delta_text
            return [ToolDelta(index=0, id=self.id, name=self.function, arguments="")]
        text, self.held = self.held + delta_text, ""
        return [ToolDelta(index=0, arguments=text)] if text else []

    def finish(self) -> list[ToolDelta]:
        return self.feed("")  # the header if nothing came, else the held text

    def extract(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(
            content=None, calls=[ToolCall(name=self.function, arguments=text, id=self.id)]
        )


class RequiredCallsParser(ToolParser):
    """``required``: the output is the grammar's ``[{"name", "parameters"}, ...]``."""

    name = "required"

    def __init__(self) -> None:
        self.seq = JsonCallSequence(",")
        self.opened = False
        self.head = ""

    def feed(self, delta_text: str) -> list[ToolDelta]:
        if not self.opened:
            self.head += delta_text
            stripped = self.head.lstrip()
            if not stripped:
                return []
            self.opened = True
            delta_text = stripped[1:] if stripped.startswith("[") else stripped
        return self.seq.feed(delta_text)

    def finish(self) -> list[ToolDelta]:
        return self.seq.finish()

    def extract(self, text: str) -> ExtractedToolCalls:
        parser = RequiredCallsParser()
        parser.feed(text)
        parser.finish()
        calls = [c for c in parser.seq.calls() if c is not None]
        return ExtractedToolCalls(content=None, calls=calls)


# ---------------------------------------------------------------------- output
class ToolOutput:
    """Per choice of one response: its parser and whether it made calls."""

    def __init__(self, plan: ToolPlan, num_choices: int, max_tokens: int | None = None) -> None:
        self.plan = plan
        self.parsers = [plan.new_parser() for _ in range(num_choices)]
        self.streams = [ToolCallStream() for _ in range(num_choices)]
        self.called = [False] * num_choices
        self.max_tokens = max_tokens

    @property
    def active(self) -> bool:
        return self.parsers[0] is not None if self.parsers else False

    @property
    def forced(self) -> bool:
        """The output is tool calls only (``required`` / named choice)."""
        return self.plan.mode in ("required", "named")

    def finish_reason(
        self, index: int, reason: str | None, num_output_tokens: int | None = None
    ) -> str | None:
        """``"tool_calls"`` for a choice that made calls and stopped; ``"length"`` for a
        forced call that used all of ``max_tokens`` (the engine closed it on its
        budget: complete and valid, but its arguments may be shortened), as OpenAI
        says ``"length"`` whenever the request's token limit was reached."""
        if reason == "stop" and self.called[index]:
            if (
                self.forced
                and self.max_tokens is not None
                and num_output_tokens is not None
                and num_output_tokens >= self.max_tokens
            ):
                return "length"
            return "tool_calls"
        return reason

    def chunk_delta(self, index: int, text: str, finished: bool) -> dict[str, Any]:
        """The chunk ``delta`` for new ``text`` of choice ``index``: ``content``
        and/or ``tool_calls`` (empty dict when there is nothing to send yet)."""
        parser = self.parsers[index]
        if parser is None:
            return {"content": text} if text else {}
        deltas = parser.feed(text)
        if finished:
            deltas += parser.finish()
        content = "".join(d.content for d in deltas if d.content is not None)
        calls = self.streams[index].entries(deltas)
        out: dict[str, Any] = {}
        if content:
            out["content"] = content
        if calls:
            self.called[index] = True
            out["tool_calls"] = calls
        return out

    def message(self, index: int, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of the whole output of choice ``index``."""
        parser = self.parsers[index]
        if parser is None:
            return text, []
        found = parser.extract(text)
        if not found.calls:
            # Nothing parsed (e.g. a forced call cut by max_tokens): the raw text.
            return text, []
        self.called[index] = True
        return found.content, [c.as_openai() for c in found.calls]
