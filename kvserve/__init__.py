"""kvserve: an LLM serving engine built around prefill processing.

Public API: ``LLM``, ``SamplingParams``, ``RequestOutput`` (imported lazily so that
``import kvserve`` stays light and torch-free until an engine is built).
"""

from __future__ import annotations

from typing import Any

from kvserve.request import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    if name == "RequestOutput":
        from kvserve.engine.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
