"""Pythonic format (Llama 3.2/4 "pythonic", ToolACE): the output is a Python list of
calls with keyword arguments of literal values,
``[get_weather(city="Paris", unit="celsius"), get_time()]``. Each call is sent
whole as soon as its closing parenthesis arrives. An output that does not start
with ``[`` followed by a name and ``(`` is plain content."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from kvserve.entrypoints.chat.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolDelta,
    ToolParser,
)

_START = re.compile(r"\s*\[\s*([A-Za-z_][\w.]*)?\s*(\()?")


def _literal(node: ast.expr) -> Any:
    value = ast.literal_eval(node)
    json.dumps(value)  # must be JSON-representable
    return value


def parse_call(source: str) -> ToolCall | None:
    """``name(k=v, ...)`` with literal values -> a call; None if it is not one."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError:
        return None
    node = tree.body
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func)
    if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
        return None
    try:
        kwargs = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
    except (ValueError, TypeError, SyntaxError):
        return None
    if len(kwargs) != len(node.keywords):
        return None
    return ToolCall(name=name, arguments=json.dumps(kwargs, ensure_ascii=False))


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self) -> None:
        self.text = ""
        self.mode: str | None = None  # None, "content", "calls"
        self.pos = 0  # scan position in text (calls mode)
        self.depth = 0  # bracket depth (the list itself is 1)
        self.quote: str | None = None
        self.call_start: int | None = None
        self.calls: list[ToolCall] = []
        self.bad = False
        self.closed = False

    def feed(self, delta_text: str) -> list[ToolDelta]:
        self.text += delta_text
        if self.mode == "content":
            return [ToolDelta(content=delta_text)] if delta_text else []
        if self.mode is None:
            m = _START.match(self.text)
            stripped = self.text.strip()
            if m is None or (m.end() == len(self.text) and m.group(2) is None):
                if stripped and (m is None or not stripped.startswith("[")):
                    self.mode = "content"
                    return [ToolDelta(content=self.text)]
                return []  # undecided
            if m.group(2) is None:
                self.mode = "content"
                return [ToolDelta(content=self.text)]
            self.mode = "calls"
        return self._scan()

    def _scan(self) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        text = self.text
        while self.pos < len(text) and not self.closed:
            ch = text[self.pos]
            if self.quote is not None:
                if ch == "\\":
                    self.pos += 2
                    continue
                if text.startswith(self.quote, self.pos):
                    self.pos += len(self.quote)
                    self.quote = None
                    continue
            elif ch in "\"'":
                triple = text[self.pos : self.pos + 3]
                if len(triple) < 3 and self.pos + 3 > len(text):
                    break  # may be a triple quote: wait
                self.quote = triple if triple in ('"""', "'''") else ch
                self.pos += len(self.quote)
                continue
            elif ch in "([{":
                self.depth += 1
                if self.depth == 2 and ch == "(" and self.call_start is None:
                    self.call_start = self._name_start(self.pos)
            elif ch in ")]}":
                self.depth -= 1
                if self.depth == 1 and ch == ")" and self.call_start is not None:
                    call = parse_call(text[self.call_start : self.pos + 1])
                    self.call_start = None
                    if call is None:
                        self.bad = True
                    else:
                        index = len(self.calls)
                        self.calls.append(call)
                        out.append(ToolDelta(index=index, id=call.id, name=call.name, arguments=""))
                        out.append(ToolDelta(index=index, arguments=call.arguments))
                elif self.depth == 0:
                    self.closed = True
            self.pos += 1
        return out

    def _name_start(self, paren: int) -> int:
        i = paren
        while i > 0 and (self.text[i - 1].isalnum() or self.text[i - 1] in "_."):
            i -= 1
        return i

    def finish(self) -> list[ToolDelta]:
        if self.mode is None and self.text:
            return [ToolDelta(content=self.text)]
        return []

    def extract(self, text: str) -> ExtractedToolCalls:
        parser = PythonicToolParser()
        deltas = parser.feed(text) + parser.finish()
        if parser.mode != "calls" or parser.bad or not parser.closed or not parser.calls:
            return ExtractedToolCalls(content=text or None, calls=[])
        del deltas
        rest = text[parser.pos :].strip()
        return ExtractedToolCalls(content=rest or None, calls=parser.calls)
