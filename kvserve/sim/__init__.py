"""``kvserve simulate``: the real schedulers and KV cache manager driven by a stand-in
executor instead of a model (no torch). See :mod:`kvserve.sim.cli` for the command and
its JSON output, :mod:`kvserve.sim.workload` for the workload file format."""

from __future__ import annotations

from kvserve.sim.runner import SimulationError, simulate
from kvserve.sim.workload import WorkloadRequest, load_workload, parse_workload

__all__ = ["SimulationError", "WorkloadRequest", "load_workload", "parse_workload", "simulate"]
