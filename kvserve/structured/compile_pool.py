"""Grammar compiles tried first in worker processes, each bounded in time and memory.

Why: llguidance walks grammars, regexes and schemas with native recursion; a
hostile one can overflow the server's stack and kill every stream in flight.
:mod:`kvserve.structured.limits` bounds sizes and depths first; this
pool is the second line. Each new constraint is compiled once in a worker
(``compile_worker``) whose compile thread has a smaller stack than the server's
own; only when it compiled there does the server compile it itself (the matcher
object cannot cross a process boundary). So:

- a compile that crashes the worker (segfault, abort) is a :class:`CompileRefused`
  ("it crashed the grammar compiler"), and the next job starts a fresh worker;
- a compile still running ``timeout_s`` after it was sent is killed (SIGKILL) and
  refused ("took longer than ...");
- each worker's address space is capped at ``memory_bytes``;
- a caller that finds every worker busy for ``timeout_s`` is refused too (busy).

:meth:`CompilePool.check` blocks; call it off the event loop. Thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 4 << 30
DEFAULT_STACK_BYTES = 64 << 20
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_START_TIMEOUT_S = 60.0


class CompileRefused(Exception):
    """The worker could not compile the constraint; ``str()`` is the reason."""

    def __init__(self, reason: str, *, busy: bool = False) -> None:
        super().__init__(reason)
        self.busy = busy


class _Worker:
    def __init__(self, spec_path: str, memory_bytes: int, stack_bytes: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p
        )
        env["KVSERVE_COMPILE_MEMORY_BYTES"] = str(memory_bytes)
        env["KVSERVE_COMPILE_STACK_BYTES"] = str(stack_bytes)
        env.setdefault("RAYON_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.structured.compile_worker", spec_path],
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

    def wait_ready(self) -> None:
        if not self.ready:
            self._frame(time.monotonic() + _START_TIMEOUT_S)
            self.ready = True

    def call(self, payload: bytes, timeout_s: float) -> dict[str, Any]:
        self.wait_ready()  # interpreter and tokenizer start: not the job's time
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack(">I", len(payload)) + payload)
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self._frame(time.monotonic() + timeout_s))
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


class CompilePool:
    """Compile checks on ``num_workers`` processes for one tokenizer (see the module
    docstring). ``tokenizer_json``: the HF fast tokenizer's ``to_str()``."""

    def __init__(
        self,
        tokenizer_json: str,
        n_vocab: int,
        eos_token_id: int | None,
        *,
        num_workers: int = 1,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        stack_bytes: int = DEFAULT_STACK_BYTES,
    ) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(
                f"invalid compile pool (num_workers={num_workers}, timeout_s={timeout_s}): "
                "use num_workers >= 1 and timeout_s > 0"
            )
        fd, self._spec_path = tempfile.mkstemp(prefix="kvserve-compile-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"tokenizer": tokenizer_json, "n_vocab": n_vocab, "eos": eos_token_id}, f)
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.stack_bytes = stack_bytes
        self._idle: list[_Worker] = []
        self._slots = threading.BoundedSemaphore(num_workers)
        self._lock = threading.Lock()
        self._closed = False
        self.num_killed = 0

    def _new_worker(self) -> _Worker:
        return _Worker(self._spec_path, self.memory_bytes, self.stack_bytes)

    def warm(self) -> None:
        """Start the workers now and wait until they are ready (blocking)."""
        with self._lock:
            while len(self._idle) < self.num_workers and not self._closed:
                self._idle.append(self._new_worker())
            workers = list(self._idle)
        for w in workers:
            with contextlib.suppress(TimeoutError, EOFError, OSError):
                w.wait_ready()

    def check(self, kind: str, value: Any) -> None:
        """Return when the constraint compiled in a worker; raise
        :class:`CompileRefused` with the reason otherwise (see the module docstring)."""
        payload = json.dumps({"kind": kind, "value": value}).encode("utf-8")
        if not self._slots.acquire(timeout=self.timeout_s):
            raise CompileRefused(
                f"every grammar compiler is busy (the server compiles {self.num_workers} new "
                "constraints at a time): retry in a moment",
                busy=True,
            )
        worker: _Worker | None = None
        try:
            with self._lock:
                if self._closed:
                    raise CompileRefused("the server is shutting down", busy=True)
                worker = self._idle.pop() if self._idle else self._new_worker()
            if worker.proc.poll() is not None:  # died while idle
                worker.kill()
                worker = self._new_worker()
            try:
                answer = worker.call(payload, self.timeout_s)
            except TimeoutError:
                worker.kill()
                worker = None
                self.num_killed += 1
                raise CompileRefused(
                    f"compiling it took longer than {self.timeout_s:g} s and was stopped: "
                    "simplify it"
                ) from None
            except (EOFError, OSError, ValueError):
                worker.kill()
                worker = None
                self.num_killed += 1
                raise CompileRefused(
                    "it crashed the grammar compiler (too deep or too large for the native "
                    "parser): simplify it"
                ) from None
            if not answer.get("ok"):
                raise CompileRefused(str(answer.get("error") or "it does not compile"))
        finally:
            if worker is not None:
                with self._lock:
                    if self._closed:
                        worker.kill()
                    else:
                        self._idle.append(worker)
            self._slots.release()

    def close(self) -> None:
        """Kill the idle workers and remove the tokenizer file."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()
        with contextlib.suppress(OSError):
            os.unlink(self._spec_path)
