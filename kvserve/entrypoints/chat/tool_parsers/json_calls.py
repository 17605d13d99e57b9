"""Streaming one JSON call object ``{"name": ..., "arguments"|"parameters": {...}}``.

:class:`CallObjectStreamer` is fed the text of one object as it arrives (starting
at its ``{``). It emits the call's first delta (id, name, empty arguments) as soon
as the ``name`` string is complete, then the raw text of the arguments value in
fragments as it arrives, and stops at the end of the value. The arguments are the
model's own text, not re-serialized, so the fragments always concatenate to the
whole value. An arguments value that is a JSON string (some models quote the
object) is held back and sent decoded in one piece at the end.
"""

from __future__ import annotations

import json
import re

from kvserve.entrypoints.chat.tool_parsers.base import (
    ToolCall,
    ToolDelta,
    arguments_text,
    json_value_end,
    new_call_id,
)

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


class CallObjectStreamer:
    """One call object's streaming state. ``index`` is the call's index in the
    choice; :attr:`done` turns True once the object's closing brace arrived."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_call_id()
        self.text = ""
        self.name: str | None = None
        self.sent_name = False
        self.args_start: int | None = None
        self.args_sent = 0
        self.args_done = False
        self.end: int | None = None  # index in text just past the object

    @property
    def done(self) -> bool:
        return self.end is not None

    def feed(self, piece: str) -> tuple[list[ToolDelta], str]:
        """Add text; returns (deltas, the part of ``piece`` past the object's end)."""
        before = len(self.text)
        self.text += piece
        end = json_value_end(self.text, 0)
        rest = ""
        if end is not None:
            rest = self.text[end:]
            self.text = self.text[:end]
            self.end = end
        del before
        return self._deltas(), rest

    def _deltas(self) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        if self.name is None:
            m = _NAME.search(self.text)
            if m is not None:
                try:
                    self.name = json.loads(f'"{m.group(1)}"')
                except ValueError:
                    self.name = m.group(1)
        if self.name is not None and not self.sent_name:
            self.sent_name = True
            out.append(ToolDelta(index=self.index, id=self.id, name=self.name, arguments=""))
        if self.args_start is None:
            m = _ARGS.search(self.text)
            if m is not None:
                self.args_start = m.end()
        if not self.sent_name or self.args_start is None or self.args_done:
            return out
        start = self.args_start
        while start < len(self.text) and self.text[start] in " \t\r\n":
            start += 1
        if start >= len(self.text):
            return out
        value_end = json_value_end(self.text, start)
        if self.text[start] == '"':  # quoted arguments: send decoded, whole
            if value_end is not None:
                self.args_done = True
                try:
                    decoded = arguments_text(json.loads(self.text[start:value_end]))
                except ValueError:
                    decoded = self.text[start:value_end]
                out.append(ToolDelta(index=self.index, arguments=decoded))
            return out
        stop = value_end if value_end is not None else len(self.text)
        if value_end is None and self.done:
            stop = len(self.text)
        fragment = self.text[start + self.args_sent : stop]
        if fragment:
            self.args_sent += len(fragment)
            out.append(ToolDelta(index=self.index, arguments=fragment))
        if value_end is not None:
            self.args_done = True
        return out

    def finish(self) -> list[ToolDelta]:
        """Flush at the end of the output (an unfinished object sends what it has)."""
        out = self._deltas()
        if self.sent_name and self.args_start is None:
            out.append(ToolDelta(index=self.index, arguments="{}"))
            self.args_done = True
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
        if self.args_start is None:
            return "{}"
        start = self.args_start
        while start < len(self.text) and self.text[start] in " \t\r\n":
            start += 1
        end = json_value_end(self.text, start) or len(self.text)
        raw = self.text[start:end]
        if raw.startswith('"'):
            try:
                return arguments_text(json.loads(raw))
            except ValueError:
                return raw
        return raw
