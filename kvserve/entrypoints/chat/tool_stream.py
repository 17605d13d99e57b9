"""What one choice's streamed ``delta.tool_calls`` may carry, whatever the parser.

A client accumulates a streamed call as the ``openai`` client does: by ``index``
(its stream helper even by list position), concatenating ``function.arguments``.
:class:`ToolCallStream` sits between a parser's :class:`ToolDelta` pieces and the
wire and keeps, per choice, the rules that make that accumulation give each call's
arguments as one JSON value:

- wire indices are 0, 1, 2, ... in the order calls begin (a parser index that
  never got a header, such as a malformed call, leaves no gap);
- a call's header (``id``, ``type``, ``name``) goes once, on its first entry;
- a call takes arguments only until the next call begins, and never past the end
  of its first complete JSON value: text after it is dropped (and logged), so two
  calls' arguments can never land under one index nor one call's be sent twice;
- one entry per call per chunk, in order, the header entry first.

``arguments(i)`` is what a client holds for wire call ``i`` so far.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvserve.entrypoints.chat.tool_parsers.base import ToolDelta, json_value_end

logger = logging.getLogger("kvserve.tools")


@dataclass
class _Call:
    wire_index: int
    arguments: str = ""
    closed: bool = False  # a later call began, or its arguments are one whole value


class ToolCallStream:
    """One choice's streamed tool calls (see the module docstring)."""

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}  # parser index -> its wire call
        self._order: list[_Call] = []

    @property
    def num_calls(self) -> int:
        return len(self._order)

    def arguments(self, wire_index: int) -> str:
        return self._order[wire_index].arguments

    def entries(self, deltas: list[ToolDelta]) -> list[dict[str, Any]]:
        """The ``delta.tool_calls`` entries for one chunk's parser deltas."""
        out: dict[int, dict[str, Any]] = {}
        for d in deltas:
            if d.index is None:
                continue
            call = self._calls.get(d.index)
            if call is None:
                if d.name is None:
                    self._drop(d, "arguments before the call's header")
                    continue
                for prev in self._order:
                    prev.closed = True
                call = _Call(len(self._order))
                self._calls[d.index] = call
                self._order.append(call)
                out[call.wire_index] = {
                    "index": call.wire_index,
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.name, "arguments": ""},
                }
            piece = self._accept(call, d)
            if not piece:
                continue
            entry = out.setdefault(
                call.wire_index, {"index": call.wire_index, "function": {"arguments": ""}}
            )
            entry["function"]["arguments"] += piece
        return [out[k] for k in sorted(out)]

    def _accept(self, call: _Call, d: ToolDelta) -> str:
        """The part of ``d.arguments`` that may still join ``call``'s arguments."""
        piece = d.arguments or ""
        if not piece:
            return ""
        if call.closed:
            self._drop(d, "arguments after the call ended")
            return ""
        text = call.arguments + piece
        end = json_value_end(text, 0)
        if end is not None:  # one whole value now: keep it, drop what follows
            if text[end:].strip():
                self._drop(d, f"text after the arguments' JSON value: {text[end:][:40]!r}")
            piece = text[len(call.arguments) : end]
            call.closed = True
        call.arguments += piece
        return piece

    @staticmethod
    def _drop(d: ToolDelta, why: str) -> None:
        logger.warning("tool call %s: dropped a streamed piece (%s)", d.index, why)
