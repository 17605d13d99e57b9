"""What every tool-call parser shares: the parsed call, the streamed delta, the
incremental JSON scanner, and the :class:`ToolParser` contract.

A parser turns the text a model generated into plain content plus tool calls.
Two ways to use one (a new parser object per choice, never shared):

- whole text: ``parser.extract(text) -> ExtractedToolCalls``;
- streaming: ``parser.feed(delta_text) -> list[ToolDelta]`` for each new piece
  of text in order, then ``parser.finish() -> list[ToolDelta]`` once. The deltas,
  concatenated per call index, give exactly the calls ``extract`` finds in the
  whole text (name once, on the call's first delta; arguments in fragments), and
  the content deltas concatenated give its content.

Text that looks like the start of a tool call is held back until it either
becomes one or cannot (then it is released as content), so no marker text leaks
into ``content``.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` + 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """One function call: ``arguments`` is JSON text (an object), as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    """The result of parsing a whole output: ``content`` is the text outside the
    calls (None when there is none), ``calls`` the calls in order."""

    content: str | None
    calls: list[ToolCall]


@dataclass
class ToolDelta:
    """One streamed piece: either ``content`` text, or a piece of call ``index``
    (``id`` and ``name`` on the call's first piece only, then ``arguments``
    fragments)."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that starts at ``text[start]`` (after
    optional whitespace), or None while ``text`` ends inside it. Scans strings,
    escapes and nesting only; whether the value is valid JSON is checked later.
    A bare scalar (number, true, false, null) is only known complete when a
    character follows it."""
    i = start
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        i += 1
        while i < n:
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        return None
    if c in "{[":
        depth = 0
        in_str = False
        while i < n:
            ch = text[i]
            if in_str:
                if ch == "\\":
                    i += 2
                    continue
                if ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < n and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < n else None


def arguments_text(value: Any) -> str:
    """A call's arguments as OpenAI's JSON text: an object's compact JSON; a JSON
    string that itself holds an object is passed through."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return json.dumps({"value": value}, ensure_ascii=False)
        if isinstance(parsed, dict):
            return value
        value = parsed
    if value is None:
        return "{}"
    return json.dumps(value, ensure_ascii=False)


class ToolParser:
    """Base class: subclasses set ``name`` and implement :meth:`extract` and the
    streaming pair. A parser object holds one choice's streaming state."""

    name = ""

    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def feed(self, delta_text: str) -> list[ToolDelta]:
        raise NotImplementedError

    def finish(self) -> list[ToolDelta]:
        raise NotImplementedError


def held_suffix(buffer: str, marker: str) -> int:
    """How many trailing characters of ``buffer`` may begin ``marker``."""
    for k in range(min(len(buffer), len(marker) - 1), 0, -1):
        if marker.startswith(buffer[-k:]):
            return k
    return 0
