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

import json
from typing import Any

from kvserve.child_process import ChildDied, FrameChild, FramePool, PoolBusy
from kvserve.entrypoints.chat.template import TemplateError, TemplateTimeoutError

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 1 << 30


class RenderBusyError(TemplateError):
    """Every render worker stayed busy for the whole timeout (answer 503, retry)."""


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
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._pool = FramePool(
            lambda: FrameChild(
                "kvserve.entrypoints.chat.render_worker",
                [],
                {"KVSERVE_RENDER_MEMORY_BYTES": str(memory_bytes)},
            ),
            name="render pool",
            num_workers=num_workers,
            timeout_s=timeout_s,
            ready_timeout_s=30.0,  # interpreter start, not the job's time
        )

    @property
    def num_killed(self) -> int:
        """Workers killed past the timeout or after a crash."""
        return self._pool.num_killed

    def warm(self) -> None:
        """Start every worker now (in the background of their interpreters' start)."""
        self._pool.warm(wait=False)

    def render(self, job: dict[str, Any]) -> list[str]:
        """One text per ``job["variants"]`` entry; see the class docstring."""
        payload = json.dumps(job, ensure_ascii=False).encode("utf-8")
        try:
            answer = self._pool.call(payload)
        except PoolBusy as e:
            raise RenderBusyError(
                "the server is shutting down"
                if e.closed
                else "every chat-template worker is busy: retry in a moment (the server "
                f"renders {self.num_workers} templates at a time)"
            ) from None
        except TimeoutError:
            raise TemplateTimeoutError(
                f"the chat template did not finish rendering within {self.timeout_s:g} s "
                "and was stopped: the template is too slow for these messages"
            ) from None
        except ChildDied:
            raise TemplateError(
                "the chat template's render worker died (it ran out of memory?): "
                "these messages cannot be rendered"
            ) from None
        if not answer.get("ok"):
            raise TemplateError(str(answer.get("error", "the chat template failed")))
        texts = answer["texts"]
        return [str(t) for t in texts]

    def close(self) -> None:
        """Kill every idle worker; busy ones are killed when their render returns."""
        self._pool.close()
