"""Hermes format (NousResearch Hermes 2/3, Qwen 2.5, the SmolLM2 template under
``examples/``): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
text outside the tags is content."""

from __future__ import annotations

from kvserve.entrypoints.chat.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolDelta,
    ToolParser,
    held_suffix,
)
from kvserve.entrypoints.chat.tool_parsers.json_calls import CallObjectStreamer

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self) -> None:
        self.buffer = ""  # unconsumed text
        self.inside = False
        self.current: CallObjectStreamer | None = None
        self.streamers: list[CallObjectStreamer] = []
        self.pending_ws = ""  # whitespace content held until non-blank content follows
        self.content: list[str] = []  # raw text of malformed calls, for extract()

    # ----------------------------------------------------------------- streaming
    def feed(self, delta_text: str) -> list[ToolDelta]:
        self.buffer += delta_text
        out: list[ToolDelta] = []
        while self.buffer:
            if not self.inside:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = held_suffix(self.buffer, OPEN)
                    text, self.buffer = (
                        self.buffer[: len(self.buffer) - keep],
                        self.buffer[len(self.buffer) - keep :],
                    )
                    out += self._content(text)
                    break
                out += self._content(self.buffer[:at])
                self.buffer = self.buffer[at + len(OPEN) :]
                self.inside = True
                self.current = None
                continue
            close = self.buffer.find(CLOSE)
            if self.current is None:
                body = self.buffer if close < 0 else self.buffer[:close]
                start = len(body) - len(body.lstrip())
                if start == len(body):  # only blanks so far
                    if close < 0:
                        break
                    self.buffer = self.buffer[close + len(CLOSE) :]
                    self.inside = False
                    continue
                self.buffer = self.buffer[start:]
                close = self.buffer.find(CLOSE)
                self.current = CallObjectStreamer(len(self.streamers))
                self.streamers.append(self.current)
            if not self.current.done:
                # The object's own scanner decides where it ends (a closing tag
                # inside one of its strings is text).
                deltas, rest = self.current.feed(self.buffer)
                out += deltas
                self.buffer = rest
                if not self.current.done:
                    break
                close = self.buffer.find(CLOSE)
            if close < 0:
                # object complete; drop text until the closing tag
                keep = held_suffix(self.buffer, CLOSE)
                self.buffer = self.buffer[len(self.buffer) - keep :] if keep else ""
                break
            self.buffer = self.buffer[close + len(CLOSE) :]
            out += self.current.finish()
            self.inside = False
        return out

    def finish(self) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        if self.inside:
            if self.current is None and self.buffer.strip():
                self.current = CallObjectStreamer(len(self.streamers))
                self.streamers.append(self.current)
                out += self.current.feed(self.buffer)[0]
            if self.current is not None:
                out += self.current.finish()
        elif self.buffer:
            out += self._content(self.buffer)
        self.buffer = ""
        if self.pending_ws and not self.streamers:
            out.append(ToolDelta(content=self.pending_ws))
        self.pending_ws = ""
        return out

    def _content(self, text: str) -> list[ToolDelta]:
        if not text:
            return []
        if not text.strip():
            self.pending_ws += text
            return []
        text, self.pending_ws = self.pending_ws + text, ""
        return [ToolDelta(content=text)]

    # ----------------------------------------------------------------- whole text
    def extract(self, text: str) -> ExtractedToolCalls:
        parser = HermesToolParser()
        deltas = parser.feed(text) + parser.finish()
        content = "".join(d.content for d in deltas if d.content is not None)
        calls: list[ToolCall] = []
        for s in parser.streamers:
            call = s.call()
            if call is None:
                content += f"{OPEN}{s.text}{CLOSE}"
            else:
                calls.append(call)
        if calls:
            content = content.strip()
        return ExtractedToolCalls(content=content or None, calls=calls)
