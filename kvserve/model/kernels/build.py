"""Build kvserve's native kernels once and load the library.

``csrc/*.cpp`` is a plain C ABI (no PyTorch headers), compiled with the system C++
compiler into ``~/.cache/kvserve/ext/<key>/`` where ``<key>`` hashes the sources, the
compiler flags, the compiler's version and this CPU's flags, so a changed source or
another machine builds afresh and an unchanged one loads in milliseconds. ``make
setup`` builds it (``python -m kvserve.model.kernels.build``); otherwise the first use
does (a few seconds). Concurrent builders are safe: each writes its own temporary file
and renames it into place. Threads come from the OpenMP runtime PyTorch already loaded.

A new csrc file must be added to :data:`SOURCES` (and get its own binding module).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [
    CSRC / n
    for n in (
        "paged_attention.cpp",
        "prefill_amx.cpp",
        "fused_ops.cpp",
        "sampling.cpp",
        "linear_panels.cpp",
        "prefill_vec.cpp",
        "linear_quant.cpp",
        "linear_kquant.cpp",  # GGUF K-quants (bindings: kvserve.model.quant.kernel)
        "attention_kv8.cpp",  # 8-bit KV cache (bindings: kvserve.model.kernels.kv8)
        "decode_step.cpp",  # all layers of a decode step (bindings: kvserve.model.llama_native)
        "lora.cpp",  # the batched LoRA delta (bindings: kvserve.lora.ops)
    )
]
# part of the cache key, found next to the sources
HEADERS = [CSRC / "kvs_common.h", CSRC / "paged_walk.h", CSRC / "quant_linear.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvserve"
    )
    return Path(root) / "ext"


def library_path(cxx: str) -> Path:
    """Where the library built by ``cxx`` from today's sources lives (built or not)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            x.encode()
            for x in (
                *(p.read_text() for p in (*SOURCES, *HEADERS)),
                " ".join(FLAGS),
                version,
                _cpu_flags(),
            )
        )
    ).hexdigest()[:16]
    return _cache_dir() / key / "libkvserve_native.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernels if their cached library is missing; return the library path.

    Raises RuntimeError (with the compiler's output) when no compiler is found or
    the build fails.
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    lib = library_path(cxx)
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=lib.parent) as objdir:
            # one compiler process per source, as many at once as there are CPUs (the
            # same objects a one-command build makes: no LTO), then one link
            compile_flags = [f for f in FLAGS if f != "-shared"]
            jobs = [
                [cxx, *compile_flags, "-c", str(src), "-o", os.path.join(objdir, f"{i}.o")]
                for i, src in enumerate(SOURCES)
            ]
            link = [cxx, *FLAGS, "-o", tmp, *(j[-1] for j in jobs)]
            for cmd in (*jobs, link) if verbose else ():
                print(" ".join(cmd), file=sys.stderr)
            with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
                procs = list(pool.map(_run, jobs))
            failed = [p for p in procs if p.returncode != 0]
            if not failed:
                failed = [p for p in [_run(link)] if p.returncode != 0]
            if failed:
                raise RuntimeError(
                    f"building the native kernels failed:\n{failed[0].stderr[-2000:]}"
                )
        os.replace(tmp, lib)  # atomic: a concurrent builder's identical file is fine
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True)


@functools.cache
def load_library() -> tuple[Path, ctypes.CDLL]:
    """Build (if needed) and load the library once per process: (path, handle).

    Raises RuntimeError or OSError where it cannot be built or loaded.
    """
    path = build()
    return path, ctypes.CDLL(str(path))


if __name__ == "__main__":
    print(build(verbose=True))
