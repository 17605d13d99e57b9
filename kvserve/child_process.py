"""A Python child process that answers length-prefixed frames, both ends, and a pool
of them.

The parent (:class:`FrameChild`) starts ``python -m MODULE ARGS`` with the package on
its path, writes each job as one frame on the child's stdin and reads one frame back
from its stdout. A frame is a 4-byte big-endian length, then that many bytes. The
child (:func:`serve_frames`) first writes one frame (``{}``: ready), then answers
every frame it reads, in order, until its stdin closes.

Rules for callers: one job at a time per child; a :class:`TimeoutError` or
:class:`EOFError` from :meth:`FrameChild.call` leaves the child in an unknown state,
so kill it (:meth:`FrameChild.kill`) and start another (:class:`FramePool` does).
Standard library only: the workers that import it stay small.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
_HEADER = struct.Struct(">I")


class FrameChild:
    """One child process running ``module`` (see the module docstring); ``env``: its
    extra environment variables."""

    def __init__(self, module: str, args: list[str], env: dict[str, str]) -> None:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, full_env.get("PYTHONPATH", "")) if p
        )
        full_env.update(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=full_env,
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

    def read_frame(self, deadline: float) -> bytes:
        """The next frame; TimeoutError past ``deadline`` (``time.monotonic()``),
        EOFError when the child closed its stdout."""
        (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        return self._read(size, deadline)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the child's ready frame, once."""
        if not self.ready:
            self.read_frame(time.monotonic() + timeout_s)
            self.ready = True

    def call(self, payload: bytes, timeout_s: float) -> bytes:
        """Send one job and return its answer, read within ``timeout_s`` of sending.
        The child must be ready (:meth:`wait_ready`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)
        self.proc.stdin.flush()
        return self.read_frame(time.monotonic() + timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class PoolBusy(Exception):
    """No child came free within the pool's timeout (``closed`` False), or the pool is
    closed (``closed`` True)."""

    def __init__(self, closed: bool) -> None:
        super().__init__("closed" if closed else "busy")
        self.closed = closed


class ChildDied(Exception):
    """The child ended, or answered something that is not JSON, during a job."""


class FramePool:
    """At most ``num_workers`` children from ``spawn``, each running one JSON job at a
    time and killed past ``timeout_s`` (then replaced on demand); an idle child that
    died is replaced before its next job. ``ready_timeout_s``: how long a new child may
    take to start (not counted in a job's time); ``name`` names the pool in the
    ValueError for a bad size or timeout. Thread-safe."""

    def __init__(
        self,
        spawn: Callable[[], FrameChild],
        *,
        name: str,
        num_workers: int,
        timeout_s: float,
        ready_timeout_s: float,
    ) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(
                f"invalid {name} (num_workers={num_workers}, timeout_s={timeout_s}): use "
                "num_workers >= 1 and timeout_s > 0, for example num_workers=2, timeout_s=5"
            )
        self._spawn = spawn
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.ready_timeout_s = ready_timeout_s
        self._idle: list[FrameChild] = []
        self._slots = threading.BoundedSemaphore(num_workers)
        self._lock = threading.Lock()
        self._closed = False
        self.num_killed = 0  # children killed past the timeout or after a crash

    def warm(self, wait: bool) -> None:
        """Start every child now; ``wait``: also wait until each is ready (blocking)."""
        with self._lock:
            while len(self._idle) < self.num_workers and not self._closed:
                self._idle.append(self._spawn())
            children = list(self._idle)
        for child in children if wait else ():
            with contextlib.suppress(TimeoutError, EOFError, OSError):
                child.wait_ready(self.ready_timeout_s)

    def call(self, payload: bytes) -> dict[str, Any]:
        """One job (``payload``: its frame) on a free child; its JSON answer. Raises
        :class:`PoolBusy`, :class:`TimeoutError` (the child took longer than
        ``timeout_s``) or :class:`ChildDied`; a child that timed out or died is killed."""
        if not self._slots.acquire(timeout=self.timeout_s):
            raise PoolBusy(closed=False)
        child: FrameChild | None = None
        try:
            with self._lock:
                if self._closed:
                    raise PoolBusy(closed=True)
                child = self._idle.pop() if self._idle else self._spawn()
            if child.proc.poll() is not None:  # died while idle (killed from outside)
                child.kill()
                child = self._spawn()
            try:
                child.wait_ready(self.ready_timeout_s)
                answer: dict[str, Any] = json.loads(child.call(payload, self.timeout_s))
            except (TimeoutError, EOFError, OSError, ValueError) as e:
                child.kill()
                child = None
                self.num_killed += 1
                if isinstance(e, TimeoutError):
                    raise
                raise ChildDied from None
            return answer
        finally:
            if child is not None:
                with self._lock:
                    if self._closed:
                        child.kill()
                    else:
                        self._idle.append(child)
            self._slots.release()

    def close(self) -> None:
        """Kill every idle child; busy ones are killed when their job returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def serve_frames(answer: Callable[[bytes], bytes]) -> int:
    """The child's loop on this process's stdin/stdout: the ready frame, then
    ``answer(job)`` for each job until stdin closes; returns 0 (the exit status)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(_HEADER.pack(2) + b"{}")  # ready
    stdout.flush()
    while True:
        header = _read_exact(stdin, _HEADER.size)
        if header is None:
            return 0
        body = _read_exact(stdin, _HEADER.unpack(header)[0])
        if body is None:
            return 0
        out = answer(body)
        stdout.write(_HEADER.pack(len(out)) + out)
        stdout.flush()
