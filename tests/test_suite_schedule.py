"""The suite's own xdist scheduler (tests/conftest.py): costliest file first, the
files of a SAME_WORKER group on one worker, and tables that name real files."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("xdist")

REPO = Path(__file__).resolve().parents[1]


def _load_conftest() -> Any:
    """tests/conftest.py by path: ``import conftest`` may give another folder's
    conftest (pytest puts several on sys.path and in sys.modules)."""
    spec = importlib.util.spec_from_file_location("_suite_conftest", REPO / "tests/conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


conftest = _load_conftest()


class _Config:
    """What xdist's LoadScopeScheduling reads of a config: two workers."""

    def __init__(self) -> None:
        self.option = type("Option", (), {"loadscopereorder": True})()

    def getvalue(self, name: str) -> Any:
        return {"numprocesses": 2, "tx": ["2*popen"]}.get(name)


class _Node:
    def __init__(self, name: str) -> None:
        self.gateway = type("Gateway", (), {"id": name})()
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def _schedule(collection: list[str], seconds: dict[str, float], groups: Any) -> list[list[str]]:
    config: Any = _Config()  # the fields xdist reads, not a whole pytest.Config
    sched = conftest._costliest_first_scheduler(config, None, seconds, groups)
    nodes = [_Node("gw0"), _Node("gw1")]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    return [[collection[i] for i in node.sent] for node in nodes]


def test_costliest_unit_first_and_a_group_on_one_worker() -> None:
    collection = [
        "a.py::t1", "a.py::t2", "a.py::t3", "a.py::t4",  # most tests, no cost listed
        "b.py::t1",  # the costliest file
        "c.py::t1", "c.py::t2", "d.py::t1",  # one group, c and d
        "e.py::t1", "e.py::t2", "e.py::t3",
    ]  # fmt: skip
    seconds = {"b.py": 50.0, "c.py": 10.0, "d.py": 30.0, "e.py": 5.0}
    gw0, gw1 = _schedule(collection, seconds, {"g": ("c.py", "d.py")})
    # b (50) to the first worker, the group (10 + 30) to the second, then b's worker,
    # with one test pending, takes the next costliest (e); a (no figure) is left
    assert gw0 == ["b.py::t1", "e.py::t1", "e.py::t2", "e.py::t3"]
    assert gw1 == ["c.py::t1", "c.py::t2", "d.py::t1"]


def test_unlisted_files_keep_xdists_order() -> None:
    collection = ["x.py::t1", "y.py::t1", "y.py::t2", "y.py::t3", "z.py::t1"]
    gw0, gw1 = _schedule(collection, {}, {})
    # xdist's own order: the file with the most tests first
    assert gw0[:3] == ["y.py::t1", "y.py::t2", "y.py::t3"]
    assert gw1 == ["x.py::t1", "z.py::t1"]


def test_the_tables_name_files_of_the_suite() -> None:
    listed = set(conftest.FILE_SECONDS) | {f for g in conftest.SAME_WORKER.values() for f in g}
    missing = sorted(f for f in listed if not (REPO / f).is_file())
    assert not missing, f"tests/conftest.py lists files that are gone: {missing}"


def test_a_worker_gets_its_share_of_the_cores() -> None:
    assert conftest.worker_threads({"PYTEST_XDIST_WORKER_COUNT": "2"}, 2) == 1
    assert conftest.worker_threads({"PYTEST_XDIST_WORKER_COUNT": "2"}, 16) == 8
    assert conftest.worker_threads({"PYTEST_XDIST_WORKER_COUNT": "4"}, 2) == 1
    # the caller's setting is kept, and one process (no xdist) uses every core
    assert (
        conftest.worker_threads({"PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "2"}, 2)
        is None
    )
    assert conftest.worker_threads({}, 2) is None


def test_this_worker_runs_its_share() -> None:
    """Under ``make test`` (2 workers) each worker's torch runs cores // 2 threads."""
    import os

    torch = pytest.importorskip("torch")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if count is None:
        pytest.skip("not under xdist")
    assert os.environ["OMP_NUM_THREADS"] == str(torch.get_num_threads())
