"""Streaming one JSON call object ``{"name": ..., "arguments"|"parameters": {...}}``.

:class:`CallObjectStreamer` is fed the text of one object as it arrives (starting
at its ``{``). It emits the call's first delta (id, name, empty arguments) as soon
as the top-level ``name`` string is complete, then the raw text of the top-level
arguments value in fragments as it arrives, and stops at the end of that value.

Invariants: only the object's own (top-level) members count, whatever their order
and whatever the arguments contain (a ``"name"`` or ``"parameters"`` key nested in
the arguments is argument text, never the call's name or a second start), so the
streamed name and arguments are exactly those :meth:`CallObjectStreamer.call`
reads from the whole object; the fragments concatenate to the model's own text of
the value, not re-serialized. An arguments value that is a JSON string (some
models quote the object) is held back and sent decoded in one piece at the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.entrypoints.chat.tool_parsers.base import (
    ToolCall,
    ToolDelta,
    arguments_text,
    json_value_end,
    new_call_id,
)

ARGUMENT_KEYS = ("arguments", "parameters")
_BLANK = " \t\r\n"


@dataclass
class Member:
    """One top-level member of a (possibly unfinished) object: its key, where its
    value starts (None: not yet) and ends (None: not yet known)."""

    key: str
    start: int | None
    end: int | None


def top_level_members(text: str) -> list[Member]:
    """The members of the object that starts at ``text[0]`` (``{``), as far as the
    text goes. Keys are decoded; a member whose key or value is unfinished is
    last, with ``start`` / ``end`` None where not yet known."""
    out: list[Member] = []
    n = len(text)
    i = 1
    while True:
        while i < n and text[i] in _BLANK + ",":
            i += 1
        if i >= n or text[i] != '"':
            return out  # the end, the closing brace, or not an object member
        key_end = json_value_end(text, i)
        if key_end is None:
            return out
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return out
        i = key_end
        while i < n and text[i] in _BLANK:
            i += 1
        if i >= n or text[i] != ":":
            return out
        i += 1
        while i < n and text[i] in _BLANK:
            i += 1
        if i >= n:
            out.append(Member(key, None, None))
            return out
        end = json_value_end(text, i)
        out.append(Member(key, i, end))
        if end is None:
            return out
        i = end


class CallObjectStreamer:
    """One call object's streaming state. ``index`` is the call's index in the
    choice; :attr:`done` turns True once the object's closing brace arrived."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_call_id()
        self.text = ""
        self.name: str | None = None
        self.sent_name = False
        self.args_sent = 0
        self.args_done = False
        self.end: int | None = None  # index in text just past the object

    @property
    def done(self) -> bool:
        return self.end is not None

    def feed(self, piece: str) -> tuple[list[ToolDelta], str]:
        """Add text; returns (deltas, the part of ``piece`` past the object's end)."""
        self.text += piece
        end = json_value_end(self.text, 0)
        rest = ""
        if end is not None:
            rest = self.text[end:]
            self.text = self.text[:end]
            self.end = end
        return self._deltas(), rest

    def _members(self) -> tuple[Member | None, Member | None]:
        """(the top-level ``name`` member, the first top-level arguments member)."""
        members = top_level_members(self.text)
        name = next((m for m in members if m.key == "name"), None)
        args = next((m for m in members if m.key in ARGUMENT_KEYS), None)
        return name, args

    def _deltas(self) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        name_m, args_m = self._members()
        if self.name is None and name_m is not None and name_m.end is not None:
            assert name_m.start is not None
            try:
                value = json.loads(self.text[name_m.start : name_m.end])
            except ValueError:
                value = None
            if isinstance(value, str):
                self.name = value
        if self.name is not None and not self.sent_name:
            self.sent_name = True
            out.append(ToolDelta(index=self.index, id=self.id, name=self.name, arguments=""))
        if not self.sent_name or args_m is None or args_m.start is None or self.args_done:
            return out
        start, value_end = args_m.start, args_m.end
        if self.text[start] == '"':  # quoted arguments: send decoded, whole
            if value_end is not None:
                self.args_done = True
                out.append(ToolDelta(index=self.index, arguments=self._decoded(start, value_end)))
            return out
        stop = value_end if value_end is not None else len(self.text)
        fragment = self.text[start + self.args_sent : stop]
        if fragment:
            self.args_sent += len(fragment)
            out.append(ToolDelta(index=self.index, arguments=fragment))
        if value_end is not None:
            self.args_done = True
        return out

    def _decoded(self, start: int, end: int) -> str:
        try:
            return arguments_text(json.loads(self.text[start:end]))
        except ValueError:
            return self.text[start:end]

    def finish(self) -> list[ToolDelta]:
        """Flush at the end of the output (an unfinished object sends what it has).
        Idempotent: a second call sends nothing."""
        out = self._deltas()
        if self.sent_name and not self.args_done and self.args_sent == 0:
            _, args_m = self._members()
            if args_m is None or args_m.start is None:
                out.append(ToolDelta(index=self.index, arguments="{}"))
        self.args_done = self.args_done or self.sent_name
        return out

    def call(self) -> ToolCall | None:
        """The parsed call when the object is complete, valid JSON and names a
        function; None otherwise."""
        if self.end is None:
            return None
        try:
            obj = json.loads(self.text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if self.name is not None and obj["name"] != self.name:
            return None  # a repeated "name" key: not what the stream sent
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict | str):
            return None
        text = self.streamed_arguments()
        try:
            parsed = json.loads(text)
        except ValueError:
            return None
        if not isinstance(parsed, dict):
            return None
        return ToolCall(name=obj["name"], arguments=text, id=self.id)

    def streamed_arguments(self) -> str:
        """The arguments text the deltas carried (what :meth:`call` reports)."""
        _, args_m = self._members()
        if args_m is None or args_m.start is None:
            return "{}"
        end = args_m.end if args_m.end is not None else len(self.text)
        if self.text[args_m.start] == '"':
            return self._decoded(args_m.start, end)
        return self.text[args_m.start : end]
