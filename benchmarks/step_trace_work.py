"""Separate what an engine did from how fast the machine ran it, over ``--step-trace`` files.

Every trace line (``kvserve serve --max-step-ms ... --step-trace FILE``) holds a step's
rows (``[new tokens, context]``) and its measured milliseconds. This script fits ONE
step-cost model (:func:`kvserve.sched.cost_model.fit_coefficients`, the engine's own
features) to the steps of all the given traces together, then reports per trace:

- ``work``: the sum of that common model's predictions over the trace's steps, i.e.
  the time its schedule would take on one and the same machine;
- ``measured``: the sum of the steps' measured times;
- ``speed``: ``work / measured`` (above 1: the process ran faster than the common fit).

Two runs of the same workload that differ only in a setting (e.g. speculation
configured or not) then compare in two independent parts: ``work`` says whether the
setting changed what the engine computed, ``speed`` how fast each process happened
to run. A decode row samples; a chunk's sampling is not in the trace and counts as
none. Steps before the trace's last pause of more than ``--gap`` seconds (the
bench client's warm-up request) are left out.

    python benchmarks/step_trace_work.py /tmp/ng1.jsonl /tmp/base1.jsonl ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvserve.sched.cost_model import fit_coefficients, step_features


def load_steps(path: Path, gap_s: float) -> list[dict[str, Any]]:
    """The trace's steps after its last pause longer than ``gap_s`` seconds."""
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    start = 0
    for i in range(1, len(steps)):
        if steps[i]["t"] - steps[i - 1]["t"] > gap_s:
            start = i
    return steps[start:]


def features(step: dict[str, Any]) -> tuple[float, float, float, float, float]:
    return step_features((int(n), int(c), int(n) == 1) for n, c in step["rows"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--gap", type=float, default=5.0, help="warm-up pause, seconds (default 5)")
    args = ap.parse_args()
    runs = {p: load_steps(p, args.gap) for p in args.traces}
    samples = [(features(s), float(s["measured_ms"])) for steps in runs.values() for s in steps]
    coef = fit_coefficients(samples)
    print("common fit (ms per unit):", ", ".join(f"{c:.3g}" for c in coef))
    print(
        f"{'trace':40s} {'steps':>6s} {'rows':>7s} {'work ms':>9s} {'measured':>9s} {'speed':>6s}"
    )
    for path, steps in runs.items():
        work = sum(sum(c * f for c, f in zip(coef, features(s), strict=True)) for s in steps)
        measured = sum(float(s["measured_ms"]) for s in steps)
        rows = sum(int(n) for s in steps for n, _ in s["rows"])
        speed = work / measured if measured > 0 else float("nan")
        print(f"{str(path):40s} {len(steps):6d} {rows:7d} {work:9.0f} {measured:9.0f} {speed:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
