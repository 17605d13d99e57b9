"""Resident memory at startup: weights, KV cache and the rest of the process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class MemoryReport:
    """Bytes: ``weights`` (every weight copy the kernels hold), ``kv`` (the KV cache
    tensor), ``runtime`` (resident set minus both: interpreter, libraries, buffers;
    None where /proc is unavailable)."""

    weights: int
    kv: int
    runtime: int | None
    weight_formats: str

    def describe(self) -> str:
        mb = 1e6
        rt = "?" if self.runtime is None else f"{self.runtime / mb:.0f}"
        return (
            f"weights {self.weights / mb:.1f} MB ({self.weight_formats}), KV "
            f"{self.kv / mb:.1f} MB, runtime {rt} MB"
        )


def memory_report(engine: Any) -> MemoryReport:
    """The report for an :class:`~kvserve.engine.engine_core.EngineCore` (its runner's
    ``kv_cache`` tensor, when it has one, and its loaded model)."""
    loaded = engine.loaded
    model = loaded.model
    weights = int(model.weight_bytes()) if hasattr(model, "weight_bytes") else 0
    kv_tensor = getattr(engine.runner, "kv_cache", None)
    kv = 0 if kv_tensor is None else kv_tensor.numel() * kv_tensor.element_size()
    rss = _rss_bytes()
    runtime = None if rss is None else max(rss - weights - kv, 0)
    return MemoryReport(weights, kv, runtime, getattr(loaded, "quantization", "float"))
