"""glibc allocator thresholds (``kvserve.engine.allocator``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A prefill layer's buffers (2,048 tokens), allocated, touched and freed 30 times on
# a thread, as the engine thread does; prints whether the thresholds are in effect
# and the page faults the loop took.
CHECK = """
import resource, threading
import torch
import kvserve.engine.allocator as a
ok = a.tune_allocator()
assert a.tune_allocator() is ok
out = {}
def layers():
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(30):
        x = torch.ones(2048, 576, dtype=torch.float32)
        g = torch.ones(2048, 3072, dtype=torch.bfloat16)
        s = torch.ones(2048, 1536, dtype=torch.bfloat16)
        del g
        d = torch.ones(2048, 576, dtype=torch.bfloat16)
        del s, d, x
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0
t = threading.Thread(target=layers)
t.start()
t.join()
print(ok, out["faults"])
"""


def _run(env_value: str | None) -> tuple[bool, int]:
    env = dict(os.environ)
    env.pop("KVSERVE_MALLOPT", None)
    if env_value is not None:
        env["KVSERVE_MALLOPT"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_step_buffers_are_not_faulted_in_again() -> None:
    ok, faults = _run(None)
    off, _ = _run("0")
    assert ok and not off
    # 30 x ~26 MB touched: ~190k pages if every buffer were faulted in again; with
    # the thresholds only the heap's first growth faults (measured 12k-21k)
    assert faults < 35_000
