"""Chat templates rendered in worker processes, each render bounded in time and memory.

Why processes: a Python thread cannot be stopped, so a template that loops for
minutes (nested ``range`` loops, exponential macros, string doubling) would hold a
thread - and the GIL - for as long as it runs. A worker process can be killed. So:

- ``num_workers`` processes (``render_worker``), started on first use (or by
  :meth:`RenderPool.warm`), each rendering one job at a time;
- a render that has not answered ``timeout_s`` after it was sent is killed
  (SIGKILL) and reported as :class:`TemplateTimeoutError`; the next render starts a
  fresh worker;
- each worker's address space is capped at ``memory_bytes`` (``RLIMIT_AS``);
- a caller that finds every worker busy for ``timeout_s`` gets
  :class:`RenderBusyError` (the server answers 503 + Retry-After).

The sandbox (``chat.template``) still applies inside the worker: the process bounds
time and memory, the sandbox bounds what the template can reach.

:meth:`RenderPool.render` blocks; the server calls it from a worker thread, never
on the event loop. Thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvserve.entrypoints.chat.template import TemplateError, TemplateTimeoutError

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 1 << 30
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])


class RenderBusyError(TemplateError):
    """Every render worker stayed busy for the whole timeout (answer 503, retry)."""


class _Worker:
    def __init__(self, memory_bytes: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p
        )
        env["KVSERVE_RENDER_MEMORY_BYTES"] = str(memory_bytes)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.chat.render_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=_PACKAGE_ROOT,
        )
        self.ready = False

    def _read(self, n: int, deadline: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        data = b""
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            readable, _, _ = select.select([fd], [], [], left)
            if not readable:
                raise TimeoutError
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def _frame(self, deadline: float) -> bytes:
        (size,) = struct.unpack(">I", self._read(4, deadline))
        return self._read(size, deadline)

    def call(self, payload: bytes, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        if not self.ready:
            self._frame(time.monotonic() + 30.0)  # interpreter start, not the job's time
            self.ready = True
            deadline = time.monotonic() + timeout_s
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack(">I", len(payload)) + payload)
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self._frame(deadline))
        return answer

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class RenderPool:
    """Render jobs (see ``render_worker``) on ``num_workers`` processes, each render
    killed after ``timeout_s``. Raises :class:`TemplateError` (the template's own
    refusal, its timeout, or :class:`RenderBusyError`)."""

    def __init__(
        self,
        *,
        num_workers: int = 2,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
    ) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(
                f"invalid render pool (num_workers={num_workers}, timeout_s={timeout_s}): use "
                "num_workers >= 1 and timeout_s > 0, for example num_workers=2, timeout_s=5"
            )
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._idle: list[_Worker] = []
        self._slots = threading.BoundedSemaphore(num_workers)
        self._lock = threading.Lock()
        self._closed = False
        self.num_killed = 0

    def warm(self) -> None:
        """Start every worker now (in the background of their interpreters' start)."""
        with self._lock:
            while len(self._idle) < self.num_workers and not self._closed:
                self._idle.append(_Worker(self.memory_bytes))

    def render(self, job: dict[str, Any]) -> list[str]:
        """One text per ``job["variants"]`` entry; see the class docstring."""
        payload = json.dumps(job, ensure_ascii=False).encode("utf-8")
        if not self._slots.acquire(timeout=self.timeout_s):
            raise RenderBusyError(
                "every chat-template worker is busy: retry in a moment (the server renders "
                f"{self.num_workers} templates at a time)"
            )
        worker: _Worker | None = None
        try:
            with self._lock:
                if self._closed:
                    raise RenderBusyError("the server is shutting down")
                worker = self._idle.pop() if self._idle else _Worker(self.memory_bytes)
            if worker.proc.poll() is not None:  # died while idle (killed from outside)
                worker.kill()
                worker = _Worker(self.memory_bytes)
            try:
                answer = worker.call(payload, self.timeout_s)
            except TimeoutError:
                worker.kill()
                worker = None
                self.num_killed += 1
                raise TemplateTimeoutError(
                    f"the chat template did not finish rendering within {self.timeout_s:g} s "
                    "and was stopped: the template is too slow for these messages"
                ) from None
            except (EOFError, OSError, ValueError):
                worker.kill()
                worker = None
                self.num_killed += 1
                raise TemplateError(
                    "the chat template's render worker died (it ran out of memory?): "
                    "these messages cannot be rendered"
                ) from None
            if not answer.get("ok"):
                raise TemplateError(str(answer.get("error", "the chat template failed")))
            texts = answer["texts"]
            return [str(t) for t in texts]
        finally:
            if worker is not None:
                with self._lock:
                    if self._closed:
                        worker.kill()
                    else:
                        self._idle.append(worker)
            self._slots.release()

    def close(self) -> None:
        """Kill every idle worker; busy ones are killed when their render returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()
