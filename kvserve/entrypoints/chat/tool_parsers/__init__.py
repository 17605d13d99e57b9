"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser NAME``): one
small class per output format, each with whole-text and streaming parsing (see
:mod:`.base` for the contract)."""

from __future__ import annotations

from kvserve.entrypoints.chat.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolDelta,
    ToolParser,
)
from kvserve.entrypoints.chat.tool_parsers.hermes import HermesToolParser
from kvserve.entrypoints.chat.tool_parsers.llama3_json import Llama3JsonToolParser
from kvserve.entrypoints.chat.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class named ``name``; ValueError listing the known names."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}: use one of {', '.join(sorted(TOOL_PARSERS))} "
            "(for example --tool-call-parser hermes)"
        ) from None


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolDelta",
    "ToolParser",
    "get_tool_parser",
]
