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
import tempfile
from typing import Any

from kvserve.child_process import ChildDied, FrameChild, FramePool, PoolBusy

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 4 << 30
DEFAULT_STACK_BYTES = 64 << 20
_START_TIMEOUT_S = 60.0


class CompileRefused(Exception):
    """The worker could not compile the constraint; ``str()`` is the reason."""

    def __init__(self, reason: str, *, busy: bool = False) -> None:
        super().__init__(reason)
        self.busy = busy


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
        env = {
            "KVSERVE_COMPILE_MEMORY_BYTES": str(memory_bytes),
            "KVSERVE_COMPILE_STACK_BYTES": str(stack_bytes),
        }
        if "RAYON_NUM_THREADS" not in os.environ:
            env["RAYON_NUM_THREADS"] = "1"
        self._pool = FramePool(  # first: it refuses a bad size before the file exists
            lambda: FrameChild("kvserve.structured.compile_worker", [self._spec_path], env),
            name="compile pool",
            num_workers=num_workers,
            timeout_s=timeout_s,
            ready_timeout_s=_START_TIMEOUT_S,  # interpreter and tokenizer start
        )
        fd, self._spec_path = tempfile.mkstemp(prefix="kvserve-compile-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"tokenizer": tokenizer_json, "n_vocab": n_vocab, "eos": eos_token_id}, f)
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.stack_bytes = stack_bytes

    @property
    def num_killed(self) -> int:
        """Workers killed past the timeout or after a crash."""
        return self._pool.num_killed

    def warm(self) -> None:
        """Start the workers now and wait until they are ready (blocking)."""
        self._pool.warm(wait=True)

    def check(self, kind: str, value: Any) -> None:
        """Return when the constraint compiled in a worker; raise
        :class:`CompileRefused` with the reason otherwise (see the module docstring)."""
        payload = json.dumps({"kind": kind, "value": value}).encode("utf-8")
        try:
            answer = self._pool.call(payload)
        except PoolBusy as e:
            if e.closed:
                raise CompileRefused("the server is shutting down", busy=True) from None
            raise CompileRefused(
                f"every grammar compiler is busy (the server compiles {self.num_workers} new "
                "constraints at a time): retry in a moment",
                busy=True,
            ) from None
        except TimeoutError:
            raise CompileRefused(
                f"compiling it took longer than {self.timeout_s:g} s and was stopped: simplify it"
            ) from None
        except ChildDied:
            raise CompileRefused(
                "it crashed the grammar compiler (too deep or too large for the native "
                "parser): simplify it"
            ) from None
        if not answer.get("ok"):
            raise CompileRefused(str(answer.get("error") or "it does not compile"))

    def close(self) -> None:
        """Kill the idle workers and remove the tokenizer file."""
        self._pool.close()
        with contextlib.suppress(OSError):
            os.unlink(self._spec_path)
