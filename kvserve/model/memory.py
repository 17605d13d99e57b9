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
    None where /proc is unavailable). ``kv_format`` / ``kv_blocks``: the KV cache's
    storage (e.g. ``int8``) and its capacity in blocks (empty / 0 when unknown)."""

    weights: int
    kv: int
    runtime: int | None
    weight_formats: str
    kv_format: str = ""
    kv_blocks: int = 0

    def describe(self) -> str:
        mb = 1e6
        rt = "?" if self.runtime is None else f"{self.runtime / mb:.0f}"
        kv_what = ", ".join(
            x for x in (self.kv_format, f"{self.kv_blocks} blocks" if self.kv_blocks else "") if x
        )
        return (
            f"weights {self.weights / mb:.1f} MB ({self.weight_formats}), KV "
            f"{self.kv / mb:.1f} MB{f' ({kv_what})' if kv_what else ''}, runtime {rt} MB"
        )


def memory_report(engine: Any) -> MemoryReport:
    """The report for an :class:`~kvserve.engine.engine_core.EngineCore` (its runner's
    ``kv_cache`` tensor, when it has one, and its loaded model)."""
    loaded = engine.loaded
    model = loaded.model
    weights = int(model.weight_bytes()) if hasattr(model, "weight_bytes") else 0
    kv_tensor = getattr(engine.runner, "kv_cache", None)
    kv = 0 if kv_tensor is None else kv_tensor.numel() * kv_tensor.element_size()
    if kv_tensor is not None and getattr(engine.runner, "kv_cache_lazy", False):
        from kvserve.model.lazy_memory import resident_bytes

        resident = resident_bytes(kv_tensor)  # a lazy pool: what is committed now
        kv = resident if resident is not None else kv
    rss = _rss_bytes()
    runtime = None if rss is None else max(rss - weights - kv, 0)
    kv_format = getattr(engine.runner, "kv_format", None)
    return MemoryReport(
        weights,
        kv,
        runtime,
        getattr(loaded, "quantization", "float"),
        kv_format=getattr(kv_format, "name", ""),
        kv_blocks=int(getattr(engine.runner, "num_kv_blocks", 0) or 0),
    )
