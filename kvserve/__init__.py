"""kvserve: an LLM serving engine built around prefill processing.

Public API: ``LLM``, ``SamplingParams``, ``RequestOutput`` (imported lazily so that
``import kvserve`` stays light and torch-free until an engine is built), and as in
vLLM ``StructuredOutputsParams`` (old name ``GuidedDecodingParams``), ``Logprob`` and
``LoRARequest``.
"""

from __future__ import annotations

from typing import Any

from kvserve.request import SamplingParams
from kvserve.structured.params import StructuredOutputsParams

GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name

__all__ = [
    "LLM",
    "GuidedDecodingParams",
    "Logprob",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvserve.entrypoints.llm import LLM

        return LLM
    if name == "RequestOutput":
        from kvserve.engine.outputs import RequestOutput

        return RequestOutput
    if name == "LoRARequest":
        from kvserve.lora.config import LoRARequest

        return LoRARequest
    if name == "Logprob":
        from kvserve.engine.offline_compat import Logprob

        return Logprob
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
