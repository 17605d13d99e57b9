"""Shared pytest fixtures."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from support.server_helpers import ServerProcess, serve_process

# ---------------------------------------------------------------------- server tests
SERVER_API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def kvserve_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real ``kvserve serve`` subprocess on the default model for the session.

    The API key comes from ``KVSERVE_API_KEY`` (so every /v1 call sends it);
    max_model_len 2048 keeps the too-long-prompt tests cheap.
    """
    args = ["--num-kv-blocks", "512", "--max-model-len", "2048", "--no-access-log"]
    tmp = tmp_path_factory.mktemp("serve")
    # 10 s on the CI machine; a shared, loaded one has taken minutes (a crash still
    # ends the wait at once)
    with serve_process(args, tmp, api_key=SERVER_API_KEY, timeout_s=600.0) as server:
        yield server


# ---------------------------------------------------------------------- xdist order
# With `--dist loadfile` (make test) a file's tests run on one worker. xdist hands out
# files by their number of tests, most first, so the few long end-to-end files (one or
# two tests each) came last and one worker ran them alone while the other sat idle.
# The scheduler below hands out the costliest work first (longest processing time
# first), from the seconds each file took in a full run (`--durations=0`, summed per
# file, 2 workers of one thread each; 2026-12-08, AMD EPYC Zen 4, 2 cores; the two
# --compile files measured alone after they moved to a small model): only their order
# matters; a file not listed costs 0
# and keeps xdist's order after the listed ones. Refresh the figures when a file's cost changes much.
FILE_SECONDS: dict[str, float] = {
    "tests/cluster/test_pools_e2e.py": 124,
    "tests/cluster/test_cluster_e2e.py": 99,
    "tests/engine/test_engine_e2e.py": 78,
    "tests/cluster/test_autoscale_ramp.py": 76,
    "tests/kv_transfer/test_disagg_e2e.py": 55,
    "tests/spec_decode/test_spec_exact.py": 52,
    "tests/determinism/test_default_reach.py": 41,
    "tests/model/test_batch_invariance.py": 39,
    "tests/model/test_synthetic.py": 35,
    "tests/model/test_model_vs_hf.py": 31,
    "tests/engine/test_kv8_engine.py": 27,
    "tests/worker/test_compiled_step.py": 26,
    "tests/lora/test_lora_engine.py": 25,
    "tests/kv_offload/test_offload_engine.py": 24,
    "tests/entrypoints/test_server_openai.py": 18,
    "tests/kv_offload/test_offload_server.py": 17,
    "tests/model/test_kv8_fidelity.py": 13,
    "tests/entrypoints/tools/test_real_clients.py": 13,
    "tests/entrypoints/test_openapi.py": 12,
    "tests/engine/test_engine_invariance.py": 12,
    "tests/lora/test_weights.py": 11,
    "tests/entrypoints/test_hardening_round2.py": 11,
    "tests/entrypoints/test_server_shutdown.py": 11,
    "tests/entrypoints/test_http_hardening.py": 11,
}

# Files that must not run at the same time as each other: one worker runs them in turn
# (each starts a local Ray cluster of several processes, and the ramp's scaling is timed
# against short delays). A file with an `xdist_group` mark must be listed under that
# group name.
SAME_WORKER: dict[str, tuple[str, ...]] = {
    "ray-cluster": (
        "tests/cluster/test_autoscale_ramp.py",
        "tests/cluster/test_cluster_e2e.py",
        "tests/cluster/test_pools_e2e.py",
    ),
}


# ---------------------------------------------------------------------- threads per worker
# Under xdist every worker (and every server or Ray replica it starts) would otherwise
# use all of the machine's cores: two workers on two cores then run four OpenMP
# threads, and a parallel region waits for a thread the OS has descheduled (the
# engine's decode step has hundreds of regions). One worker's share of the cores
# instead: `make test` on 2 cores went from 738 s to 548 s of pytest (2026-12-08,
# AMD EPYC Zen 4), every test passing. Tests that need a thread count set their own
# (torch.set_num_threads), and an OMP_NUM_THREADS set by the caller is kept.


def worker_threads(environ: dict[str, str] | os._Environ[str], cores: int) -> int | None:
    """Threads for one xdist worker: ``cores // workers`` (at least 1), or None outside
    xdist or where the caller set ``OMP_NUM_THREADS`` (theirs is kept)."""
    count = environ.get("PYTEST_XDIST_WORKER_COUNT")
    if count is None or "OMP_NUM_THREADS" in environ:
        return None
    return max(1, cores // max(1, int(count)))


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker: its share of the cores (:func:`worker_threads`), in
    ``OMP_NUM_THREADS`` for the processes it starts and in torch for its own tests."""
    threads = worker_threads(os.environ, os.cpu_count() or 1)
    if threads is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # imported already: the variable alone is read too late
        sys.modules["torch"].set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse an ``xdist_group`` mark that :data:`SAME_WORKER` does not list (the
    scheduler groups by this table; the marks alone do nothing under loadfile)."""
    for item in items:
        for mark in item.iter_markers("xdist_group"):
            group = str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            if item.nodeid.split("::", 1)[0] not in SAME_WORKER.get(group, ()):
                raise pytest.UsageError(
                    f"{item.nodeid}: xdist_group {group!r} is not listed in "
                    "tests/conftest.py SAME_WORKER"
                )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadfile``: :func:`_costliest_first_scheduler`; else xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    return _costliest_first_scheduler(config, log)


def _costliest_first_scheduler(
    config: pytest.Config,
    log: Any,
    seconds: dict[str, float] | None = None,
    groups: dict[str, tuple[str, ...]] | None = None,
) -> Any:
    """xdist's file scheduler, with two changes: the files of a group (``groups``,
    default :data:`SAME_WORKER`) are one unit of work, and the next unit a worker gets
    is the costliest left (``seconds``, default :data:`FILE_SECONDS`; a group's files
    summed). Everything else (when a worker gets more work, shutdown) is xdist's."""
    from xdist.scheduler import LoadFileScheduling

    seconds = FILE_SECONDS if seconds is None else seconds
    groups = SAME_WORKER if groups is None else groups
    group_of = {f: g for g, files in groups.items() for f in files}
    cost = {path: float(s) for path, s in seconds.items()}
    cost.update({g: sum(seconds.get(f, 0.0) for f in files) for g, files in groups.items()})

    class CostliestFirst(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return group_of.get(path, path)

        def _assign_work_unit(self, node: Any) -> None:
            # max() keeps the first of equal costs: unlisted files stay in xdist's order
            unit = max(self.workqueue, key=lambda u: cost.get(u, 0.0))
            self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return CostliestFirst(config, log)


# ---------------------------------------------------------------------- model tests
class _ModelPool:
    """Loads of the default model by name, reused once nothing else holds them.

    ``load_model`` of the default model costs seconds of CPU (GGUF parse and repack),
    and the suite builds dozens of engines on it. The pool hands a caller a model only
    while no other object references it (its nn.Module's reference count is back to
    what it was when the pool loaded it), so two live engines never share one model
    (a runner sets the model's batch-invariant routing, see ModelRunner). Only the
    default model by name is pooled (paths and other names load as before); dtype,
    device, quantization and every ``KVSERVE_*`` kernel switch are the key. A test that
    checks loading itself imports ``load_model`` at collection and gets the real one.
    """

    # a long-lived engine (a module fixture) may hold one; short-lived ones share the other
    MAX_PER_KEY = 2

    def __init__(self, real: Any, default_name: str) -> None:
        self.real = real
        self.default_name = default_name
        self.free: dict[tuple[Any, ...], list[tuple[Any, int]]] = {}

    def __call__(
        self,
        model: Any = None,
        dtype: str = "auto",
        device: str = "cpu",
        quantization: str = "auto",
    ) -> Any:
        model = self.default_name if model is None else model
        if model != self.default_name:
            return self.real(model, dtype=dtype, device=device, quantization=quantization)
        env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("KVSERVE_")))
        key = (dtype, device, quantization, env)
        entries = self.free.setdefault(key, [])
        for collected in (False, True):
            if collected:
                gc.collect()  # an engine dropped in a reference cycle still holds its model
            for entry in entries:
                # references of an idle entry: its tuple here (and the argument); of
                # its module: the LoadedModel's field (and the argument)
                if sys.getrefcount(entry[0]) <= 2 and sys.getrefcount(entry[0].model) <= entry[1]:
                    return entry[0]
        loaded = self.real(model, dtype=dtype, device=device, quantization=quantization)
        if len(entries) < self.MAX_PER_KEY:
            entries.append((loaded, sys.getrefcount(loaded.model)))
        return loaded


@pytest.fixture(scope="session", autouse=True)
def _shared_default_model_loads() -> Iterator[None]:
    """Engines built without ``loaded=`` reuse idle loads of the default model (see
    :class:`_ModelPool`); the pool and its models go at the end of the session."""
    from kvserve.model import loader

    real = loader.load_model
    loader.load_model = _ModelPool(real, loader.DEFAULT_MODEL_NAME)
    yield
    loader.load_model = real


class _CalibrationPool:
    """Step-time fits shared across context lengths: one per model, dtype, device,
    thread count, block and segment size and compile flag.

    The engine's own cache (``step_cost.cached_calibration``) also keys on the shapes
    as cut to ``max_model_len`` (every length under 2,624 tokens cuts them its own
    way); the suite builds engines with a dozen different lengths, and each paid a
    calibration of seconds.
    Here an engine gets the fit made for the longest ``max_model_len`` seen so far
    when that is at least its own (a fit over longer contexts covers the shorter ones);
    otherwise it calibrates on its own runner, as the engine would, and that fit
    becomes the one to share. Every engine still gets a fresh copy (own online state).
    """

    def __init__(self, real: Any) -> None:
        self.real = real
        self.longest: dict[tuple[Any, ...], int] = {}

    def __call__(self, runner: Any, *, vocab_size: int, max_model_len: int) -> Any:
        import torch

        key = (
            runner.loaded.fingerprint,
            str(runner.loaded.dtype),
            str(runner.device),
            torch.get_num_threads(),
            runner.block_size,
            runner.kv_segment_size,
            runner.compiled is not None,
        )
        known = self.longest.get(key, 0)
        if known >= max_model_len:  # in the engine's cache already: no calibration
            return self.real(runner, vocab_size=vocab_size, max_model_len=known)
        self.longest[key] = max_model_len
        return self.real(runner, vocab_size=vocab_size, max_model_len=max_model_len)


@pytest.fixture(scope="session", autouse=True)
def _shared_step_cost_fits() -> Iterator[None]:
    """Engines with the step-time budget on share fits across ``max_model_len`` (see
    :class:`_CalibrationPool`). Tests of calibration itself call ``calibrate``."""
    from kvserve.worker import step_cost

    real = step_cost.cached_calibration
    step_cost.cached_calibration = _CalibrationPool(real)  # type: ignore[assignment]
    yield
    step_cost.cached_calibration = real


# (kvserve and transformers are imported inside the fixtures, so collecting the other
# tests stays cheap)


@pytest.fixture(scope="session")
def default_model_dir():
    """HF folder of the default model (converted from its GGUF once, then cached)."""
    from kvserve.model.loader import DEFAULT_MODEL_NAME, resolve_model

    return resolve_model(DEFAULT_MODEL_NAME)


@pytest.fixture(scope="session")
def small_model_dir(default_model_dir, tmp_path_factory):
    """HF folder of a 2-layer random model of the default model's layout
    (support.tiny_models.save_small_llama_like_default; token ids below 1024)."""
    from support.tiny_models import save_small_llama_like_default

    folder = tmp_path_factory.mktemp("small-model")
    save_small_llama_like_default(folder, default_model_dir)
    return folder


@pytest.fixture(scope="session")
def loaded_model(default_model_dir):
    """kvserve's default model in fp32 on CPU, loaded once per session."""
    from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model

    # parity tests pin float32 dequantized weights
    return load_model(DEFAULT_MODEL_NAME, dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    """HF transformers' model on the same converted weights (fp32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def single_thread_torch():
    """Run a module's tests with one torch thread, then restore the setting.

    On a machine shared with other busy processes every multi-threaded op can wait a
    whole scheduler time slice for its second thread; one thread keeps the model
    tests fast there. Results do not depend on the thread count beyond rounding.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
