"""Engine construction off the main thread (``run_in_scratch_thread``)."""

from __future__ import annotations

import threading

import pytest

from kvserve.engine.threads import run_in_scratch_thread


def test_run_in_scratch_thread_returns_raises_and_leaves_no_thread_behind():

    seen: list[threading.Thread] = []

    def build() -> int:
        seen.append(threading.current_thread())
        return 42

    assert run_in_scratch_thread(build) == 42
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()

    def fail() -> None:
        raise ValueError("bad option")

    with pytest.raises(ValueError, match="bad option"):
        run_in_scratch_thread(fail)


def test_serve_builds_its_engine_on_a_scratch_thread(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The engine thread must be the only thread that ran OpenMP kernels (see
    # run_in_scratch_thread); a bad option raised there still reaches the user.
    import argparse

    import kvserve.engine.engine_core as engine_core
    from kvserve.entrypoints import serve_cmd

    built_on: list[threading.Thread] = []

    def fake_engine(*args: object, **kwargs: object) -> None:
        built_on.append(threading.current_thread())
        raise ValueError("no such model here")

    monkeypatch.setattr(engine_core, "EngineCore", fake_engine)
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    assert serve_cmd.run(parser.parse_args([])) == 2
    assert "no such model here" in capsys.readouterr().err
    assert built_on and built_on[0] is not threading.main_thread()
