"""Thread pools that keep CPU work off the event loop.

The event loop of the server only moves bytes: everything that can take more than
a millisecond on a large input runs in a :class:`CpuPool` - JSON parsing and
validation of request bodies, tokenization of prompts, chat rendering (which waits
on a render worker process), detokenization of long token lists. Tokenizers and
the render pool release the GIL while they work, so ``/health`` and the streams of
other requests keep being served. Pure-Python work in a pool thread still takes the
GIL, but in slices of ``sys.getswitchinterval()`` (5 ms), never for a whole call.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Inputs below this many characters / token ids are handled on the event loop.
INLINE_LIMIT = 4096


class CpuPool:
    """``await pool.run(fn, *args, **kwargs)``: ``fn`` on one of ``max_workers``
    threads. Exceptions propagate to the awaiting coroutine."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def run_unless_small(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` inline when ``size`` (characters or token ids of its input) is
        below :data:`INLINE_LIMIT` (tens of microseconds: cheaper than a thread hop,
        which matters for a burst of short requests), else on a pool thread."""
        if size < INLINE_LIMIT:
            return fn(*args)
        return await self.run(fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
