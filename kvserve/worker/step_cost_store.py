"""A step-time fit persisted per machine, model and shapes, so every start of the same
configuration on the same machine makes the same scheduling decisions.

Why: a startup fit measures a few dozen steps; on a shared machine a burst of other
work during those seconds changes the coefficients (measured: 0.46-3.8 ms per token
across starts a minute apart), and with them every chunk size and bucket of the run.
Load only ever slows a step, so the fastest steady fit is the machine's own speed; it
is stored in ``$KVSERVE_CACHE_DIR/step_cost/`` (default ``~/.cache/kvserve/step_cost/``)
as JSON, one file per :func:`fit_key`, and reused (then corrected online, as a fresh
fit would be). ``kvserve.worker.step_cost.cached_calibration`` decides when to refit.

Rules for callers: a stored fit is used only when its whole key equals the runner's
(:func:`load` checks, so a hash collision or a changed field reads as absent); a file
that cannot be read or parsed is absent, never an error; :func:`save` never raises
(a read-only cache only costs a calibration per start).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from kvserve.config import SchedulerConfig
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.loader import LoadedModel
from kvserve.sched.cost_model import FEATURE_NAMES, NUM_FEATURES, CostModel, Features
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput


class TimedRunner(Protocol):
    """What calibration reads of the runner it times (``worker.model_runner.ModelRunner``
    has it all; neither module here imports it, so the runner and its calibration are
    no cycle)."""

    @property
    def loaded(self) -> LoadedModel: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def block_size(self) -> int: ...
    @property
    def kv_segment_size(self) -> int: ...
    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def scheduler_config(self) -> SchedulerConfig: ...
    @property
    def kv_format(self) -> object: ...
    @property
    def attention_backend(self) -> str: ...
    @property
    def kernels(self) -> KernelBackend: ...
    @property
    def compiled(self) -> object | None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


logger = logging.getLogger(__name__)

# Bump when the calibration's measurement, the model's features or the key change meaning.
STORE_VERSION = 3
CACHE_MODES = ("auto", "refresh", "off")


def store_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvserve"
    )
    return Path(root) / "step_cost"


def _cpu() -> dict[str, str]:
    """The processor: model name and a hash of its flags (Linux /proc/cpuinfo), core count."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name in ("", platform.machine(), platform.processor()):
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
    except OSError:
        pass
    return {
        "cpu": name,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:12],
        "cpu_count": str(os.cpu_count()),
    }


def fit_key(runner: TimedRunner, shapes: object) -> dict[str, str]:
    """Everything a fit's coefficients depend on: the machine (processor, cores,
    torch and its thread count), the model (fingerprint, dtype, KV format, kernels in
    use and their build), the cache layout and the calibration shapes as timed
    (``shapes``: already cut to the cache and ``max_model_len``, so lengths that time
    the same steps share a fit)."""
    kernels = runner.kernels
    families = sorted(
        name
        for name in ("attention", "prefill_amx", "prefill_vec", "norms", "linear", "quant_linear")
        if getattr(kernels, name, None) is not None
    )
    library = getattr(kernels, "library", None)
    return {
        "version": str(STORE_VERSION),
        "features": ",".join(FEATURE_NAMES),
        **_cpu(),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "model": str(runner.loaded.fingerprint),
        "dtype": str(runner.loaded.dtype),
        "device": str(runner.device),
        "kv_format": str(getattr(runner.kv_format, "name", runner.kv_format)),
        "attention_backend": str(runner.attention_backend),
        "kernels": ",".join(families),
        "kernel_build": Path(library).parent.name if library else "",
        "block_size": str(runner.block_size),
        "kv_segment_size": str(runner.kv_segment_size),
        "compiled": str(runner.compiled is not None),
        "shapes": repr(shapes),
    }


def path_for(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return store_dir() / f"{digest}.json"


def _valid_coef(values: Any) -> Features | None:
    if not isinstance(values, list) or len(values) != NUM_FEATURES:
        return None
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            return None
        out.append(float(v))
    return (out[0], out[1], out[2], out[3], out[4])


def load(key: dict[str, str]) -> CostModel | None:
    """The fit stored under ``key`` (a fresh :class:`CostModel`, source ``stored``), or
    None when there is none, its key differs, or the file is unreadable."""
    path = path_for(key)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("step-time fit %s unreadable (%s): ignored", path, e)
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    coef = _valid_coef(data.get("coef"))
    if coef is None:
        logger.warning("step-time fit %s has invalid coefficients: ignored", path)
        return None
    calibration: list[tuple[Features, float]] = []
    for item in data.get("calibration", []):
        try:
            f, ms = item
            feats = _valid_coef(list(f))
        except (TypeError, ValueError):
            feats = None
        if feats is not None and isinstance(ms, int | float) and ms > 0:
            calibration.append((feats, float(ms)))
    model = CostModel(coef, calibration=calibration, source=f"stored {path.name}")
    model.spread = float(data.get("spread", 0.0) or 0.0)
    return model


def save(key: dict[str, str], model: CostModel) -> Path | None:
    """Store ``model``'s coefficients and calibration under ``key`` (atomically);
    returns the path, or None when the cache cannot be written (logged)."""
    path = path_for(key)
    data = {
        "key": key,
        "coef": list(model.coef),
        "calibration": [[list(f), ms] for f, ms in model.calibration],
        "spread": model.spread,
        "describe": model.describe(),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not store the step-time fit in %s (%s)", path.parent, e)
        return None
    return path
