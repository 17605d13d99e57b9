"""Server subprocesses for the benchmarks and the tests: a free port, the wait for
``GET /health``, and a graceful stop.

Rules for callers: the process a caller starts is the caller's to stop, also when
:func:`wait_healthy` raises (it never kills it); :func:`stop_process` is safe on a
process that already exited and on None.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(
    base_url: str,
    proc: subprocess.Popen[bytes] | None,
    timeout_s: float,
    *,
    what: str = "server",
    poll_s: float = 0.2,
    log_tail: Callable[[], str] | None = None,
) -> float:
    """Poll ``base_url``/health until it answers 200; return the seconds that took.

    RuntimeError when ``proc`` (the ``what`` serving it, None if not ours) exits
    first or ``timeout_s`` passes; the message ends with ``log_tail()`` when given.
    """
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            why = f"{what} exited with code {proc.returncode} before becoming healthy"
            break
        try:
            if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            why = f"{what} at {base_url} not healthy after {timeout_s:.0f} s"
            break
        time.sleep(poll_s)
    raise RuntimeError(why + (f"\n{log_tail()}" if log_tail is not None else ""))


def stop_process(
    proc: subprocess.Popen[bytes] | None, timeout_s: float = 30.0, sig: int = signal.SIGTERM
) -> int | None:
    """Send ``sig`` (a graceful stop), SIGKILL past ``timeout_s``; return the exit code
    (None for None: nothing to stop)."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
