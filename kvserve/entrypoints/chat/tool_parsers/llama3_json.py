"""Llama 3.x JSON format: the output is one or more call objects
``{"name": ..., "parameters": {...}}`` (``"arguments"`` accepted too), separated by
``;`` and optionally led by ``<|python_tag|>``. An output that does not start
with ``{`` (after blanks and the tag) is plain content."""

from __future__ import annotations

from kvserve.entrypoints.chat.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolDelta,
    ToolParser,
)
from kvserve.entrypoints.chat.tool_parsers.json_calls import CallObjectStreamer

PYTHON_TAG = "<|python_tag|>"


class JsonCallSequence:
    """Call objects one after another, separated by ``separators`` and blanks; used
    by llama3_json (``;``) and by forced tool choice (``[obj, obj]``, ``,``)."""

    def __init__(self, separators: str) -> None:
        self.separators = separators
        self.streamers: list[CallObjectStreamer] = []
        self.current: CallObjectStreamer | None = None
        self.tail = ""  # text after the last object that is not a separator
        self.buffer = ""

    def feed(self, text: str) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        self.buffer += text
        while self.buffer:
            if self.current is None or self.current.done:
                stripped = self.buffer.lstrip(" \t\r\n" + self.separators)
                if not stripped:
                    self.buffer = ""
                    break
                if stripped[0] != "{":
                    self.tail += stripped
                    self.buffer = ""
                    break
                self.buffer = stripped
                self.current = CallObjectStreamer(len(self.streamers))
                self.streamers.append(self.current)
            deltas, rest = self.current.feed(self.buffer)
            out += deltas
            self.buffer = rest
            if not self.current.done:
                break
            out += self.current.finish()
        return out

    def finish(self) -> list[ToolDelta]:
        if self.current is not None and not self.current.done:
            return self.current.finish()
        return []

    def calls(self) -> list[ToolCall | None]:
        return [s.call() for s in self.streamers]


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self) -> None:
        self.head = ""  # text before deciding whether this is a call or content
        self.mode: str | None = None  # None (undecided), "content", "calls"
        self.calls = JsonCallSequence(";")

    def feed(self, delta_text: str) -> list[ToolDelta]:
        if self.mode == "content":
            return [ToolDelta(content=delta_text)] if delta_text else []
        if self.mode == "calls":
            return self.calls.feed(delta_text)
        self.head += delta_text
        probe = self.head.lstrip()
        if probe.startswith(PYTHON_TAG):
            probe = probe[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(probe):
            return []  # may still be the tag
        if not probe:
            return []
        if probe[0] == "{":
            self.mode = "calls"
            return self.calls.feed(probe)
        self.mode = "content"
        text, self.head = self.head, ""
        return [ToolDelta(content=text)]

    def finish(self) -> list[ToolDelta]:
        if self.mode is None:
            return [ToolDelta(content=self.head)] if self.head else []
        if self.mode == "calls":
            return self.calls.finish()
        return []

    def extract(self, text: str) -> ExtractedToolCalls:
        parser = Llama3JsonToolParser()
        deltas = parser.feed(text) + parser.finish()
        if parser.mode != "calls":
            content = "".join(d.content or "" for d in deltas)
            return ExtractedToolCalls(content=content or None, calls=[])
        found = parser.calls.calls()
        if not found or any(c is None for c in found):
            return ExtractedToolCalls(content=text, calls=[])
        calls = [c for c in found if c is not None]
        tail = parser.calls.tail.strip()
        return ExtractedToolCalls(content=tail or None, calls=calls)
