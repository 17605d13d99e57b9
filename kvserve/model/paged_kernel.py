"""The native paged-attention kernel: build once, load with ctypes, call per layer.

``csrc/paged_attention.cpp`` is a plain C ABI (no PyTorch headers), compiled with the
system C++ compiler into ``~/.cache/kvserve/ext/<key>/`` where ``<key>`` hashes the
source, the compiler flags, the compiler's version and this CPU's flags, so a changed
source or another machine builds afresh and an unchanged one loads in milliseconds.
``make setup`` builds it (``python -m kvserve.model.paged_kernel``); otherwise the
first use does (about 2 s). Concurrent builders are safe: each writes its own
temporary file and renames it into place.

Where no compiler works, or ``KVSERVE_ATTENTION=portable`` is set, :func:`get_kernel`
returns None and attention uses the portable PyTorch path in
:mod:`kvserve.model.attention` (the reference the tests compare against).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ENV_VAR = "KVSERVE_ATTENTION"  # "native" (default when it builds) or "portable"


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


def _library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            x.encode() for x in (_SOURCE.read_text(), " ".join(_FLAGS), version, _cpu_flags())
        )
    ).hexdigest()[:16]
    return _cache_dir() / key / "libkvs_paged_attention.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernel if its cached library is missing; return the library path.

    Raises RuntimeError (with the compiler's output) when no compiler is found or
    the build fails.
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    lib = _library_path(cxx)
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, "-o", tmp, str(_SOURCE)]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {_SOURCE.name} failed:\n{proc.stderr[-2000:]}")
    os.replace(tmp, lib)  # atomic: a concurrent builder's identical file is fine
    return lib


class PagedAttentionKernel:
    """ctypes binding of ``kvs_paged_attention``; see the C++ source for the contract."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        fn = lib.kvs_paged_attention
        i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        fn.argtypes = [vp, i64, i64, vp, vp, i64, i32, i32, i32, i32, vp, i64, vp, i64, i32]
        fn.argtypes += [ctypes.c_float, i32, i32, i32]
        fn.restype = i32
        self._fn = fn

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        seqs: torch.Tensor,
        block_tables: torch.Tensor,
        kv_segment_size: int,
        scale: float,
        row_tile: int = 16,
    ) -> torch.Tensor:
        """q [T, H, D] (last dim contiguous) -> out [T, H, D].

        Rules: ``kv_cache`` [2, Hk, blocks, block_size, D] contiguous in q's dtype (one
        of float32/bfloat16), on the CPU; ``seqs`` [S, 4] int64 contiguous rows of
        (row_start, num_rows, num_tokens, cached_seq_len) covering ``[0, T)``;
        ``block_tables`` [S, max_blocks] int64 contiguous with valid block ids for
        every visible position. The kernel does not check bounds.
        """
        num_tokens, num_heads, head_dim = q.shape
        _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
        rc = self._fn(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            out.data_ptr(),
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            num_heads,
            num_kv_heads,
            head_dim,
            seqs.data_ptr(),
            seqs.shape[0],
            block_tables.data_ptr(),
            block_tables.shape[1],
            kv_segment_size,
            scale,
            _DTYPES[q.dtype],
            row_tile,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"kvs_paged_attention returned {rc} for dtype {q.dtype}")
        return out


@functools.cache
def _load() -> PagedAttentionKernel | None:
    try:
        return PagedAttentionKernel(build())
    except (RuntimeError, OSError) as e:
        logger.warning("native paged attention unavailable, using portable: %s", e)
        return None


def get_kernel() -> PagedAttentionKernel | None:
    """The kernel, built or loaded on first call (then cached); None means "use portable".

    None when ``KVSERVE_ATTENTION=portable`` or when the build fails (logged once).
    """
    if os.environ.get(ENV_VAR, "native") == "portable":
        return None
    return _load()


if __name__ == "__main__":
    print(build(verbose=True))
