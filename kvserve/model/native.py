"""kvserve's native CPU kernels: build once, load with ctypes, call per layer.

``csrc/*.cpp`` (paged attention; AMX and AVX-512/AVX2 prefill attention; fused
add+RMSNorm, SiLU*mul,
RoPE+KV write; sampling helpers) is a
plain C ABI (no PyTorch headers), compiled with the system C++ compiler into
``~/.cache/kvserve/ext/<key>/`` where ``<key>`` hashes the sources, the compiler flags,
the compiler's version and this CPU's flags, so a changed source or another machine
builds afresh and an unchanged one loads in milliseconds. ``make setup`` builds it
(``python -m kvserve.model.native``); otherwise the first use does (about 3 s).
Concurrent builders are safe: each writes its own temporary file and renames it into
place. Threads come from the OpenMP runtime PyTorch already loaded.

Where no compiler works, or ``KVSERVE_ATTENTION=portable`` is set, :func:`get_kernel`
returns None and the model uses its portable PyTorch path (the reference the tests
compare against).
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
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [
    _CSRC / n
    for n in (
        "paged_attention.cpp",
        "prefill_amx.cpp",
        "fused_ops.cpp",
        "sampling.cpp",
        "linear_panels.cpp",
        "prefill_vec.cpp",
        "linear_quant.cpp",
        "attention_kv8.cpp",  # 8-bit KV cache (bindings: kvserve.model.kernels_kv8)
    )
]
_HEADERS = [_CSRC / "kvs_common.h"]  # part of the cache key, found next to the sources
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ENV_VAR = "KVSERVE_ATTENTION"  # "native" (default when it builds) or "portable"
AMX_ENV_VAR = "KVSERVE_PREFILL_AMX"  # "0" keeps prefill chunks off the AMX kernel
# prefill chunks on CPUs without AMX: "0" keeps them off the vector prefill kernel;
# "avx2", "avx512", "avx512bf16" force that variant (where usable), "1"/unset: the best
VEC_ENV_VAR = "KVSERVE_PREFILL_VEC"
PREFILL_VEC_ISAS = {"avx2": 1, "avx512": 2, "avx512bf16": 3}


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
            x.encode()
            for x in (
                *(p.read_text() for p in (*_SOURCES, *_HEADERS)),
                " ".join(_FLAGS),
                version,
                _cpu_flags(),
            )
        )
    ).hexdigest()[:16]
    return _cache_dir() / key / "libkvserve_native.so"


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
    cmd = [cxx, *_FLAGS, "-o", tmp, *(str(p) for p in _SOURCES)]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building the native kernels failed:\n{proc.stderr[-2000:]}")
    os.replace(tmp, lib)  # atomic: a concurrent builder's identical file is fine
    return lib


class PagedAttentionKernel:
    """ctypes bindings of the native kernels; see the C++ sources for each contract.

    Calling the object runs paged attention; :meth:`add_rms_norm`, :meth:`silu_mul`
    and :meth:`rope_and_cache` are the fused layer ops.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        i64, i32, vp, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        fn = lib.kvs_paged_attention
        fn.argtypes = [vp, i64, i64, vp, vp, i64, i32, i32, i32, i32, vp, i64, vp, i64, i32]
        fn.argtypes += [f32, i32, i32, i32, vp, vp, i32]
        fn.restype = i32
        self._fn = fn
        self._norm = lib.kvs_add_rms_norm
        self._norm.argtypes = [vp, vp, i64, vp, vp, i64, i64, f32, i32, i32]
        self._norm.restype = i32
        self._silu = lib.kvs_silu_mul
        self._silu.argtypes = [vp, vp, i64, i64, i32, i32]
        self._silu.restype = i32
        self._rope = lib.kvs_rope_and_cache
        self._rope.argtypes = [vp, i64, i64, i32, i32, i32, vp, vp, vp, vp, i64, vp, i32, i32]
        self._rope.restype = i32
        self._argmax = lib.kvs_argmax_rows
        self._argmax.argtypes = [vp, i64, i64, vp, i32]
        self._argmax.restype = None
        self._top_p = lib.kvs_top_p_threshold
        self._top_p.argtypes = [vp, i64, i64, vp, vp, i32]
        self._top_p.restype = None
        self._sample = lib.kvs_sample_rows
        self._sample.argtypes = [vp, i64, i64, vp, vp, vp, i32]
        self._sample.restype = None
        self._softmax = lib.kvs_softmax_rows
        self._softmax.argtypes = [vp, i64, i64, vp, vp, i32]
        self._softmax.restype = None
        self._amx = lib.kvs_prefill_attention_amx
        self._amx.argtypes = [vp, i64, i64, vp, vp, i64, i32, i32, i32, i32, vp, i64, vp, i64]
        self._amx.argtypes += [f32, i32, vp, vp, i32]
        self._amx.restype = i32
        lib.kvs_prefill_amx_available.restype = i32
        self.amx_available: bool = bool(lib.kvs_prefill_amx_available())
        self._linear_f32 = lib.kvs_linear_f32
        self._linear_f32.argtypes = [vp, i64, i64, i64, vp, i64, vp, vp, i64, i32]
        self._linear_f32.restype = i32
        lib.kvs_linear_f32_available.restype = i32
        self.linear_f32_available: bool = bool(lib.kvs_linear_f32_available())
        self._linear_bf16 = lib.kvs_linear_bf16
        self._linear_bf16.argtypes = [vp, i64, i64, i64, vp, i64, vp, vp, i64, i32]
        self._linear_bf16.restype = i32
        lib.kvs_linear_bf16_available.restype = i32
        self.linear_bf16_available: bool = bool(lib.kvs_linear_bf16_available())
        self._linear_bf16_amx = lib.kvs_linear_bf16_amx
        self._linear_bf16_amx.argtypes = self._linear_bf16.argtypes
        self._linear_bf16_amx.restype = i32
        lib.kvs_linear_bf16_amx_available.restype = i32
        self.linear_bf16_amx_available: bool = bool(lib.kvs_linear_bf16_amx_available())
        self._vec = lib.kvs_prefill_attention_vec
        self._vec.argtypes = [vp, i64, i64, vp, vp, i64, i32, i32, i32, i32, vp, i64, vp, i64]
        self._vec.argtypes += [f32, i32, i32, i32, vp, vp, i32]
        self._vec.restype = i32
        lib.kvs_prefill_vec_isas.restype = i32
        bits = int(lib.kvs_prefill_vec_isas())
        # the usable variants of prefill_attention_vec, by name (see PREFILL_VEC_ISAS)
        self.prefill_vec_isas: frozenset[str] = frozenset(
            name for name, bit in PREFILL_VEC_ISAS.items() if bits & (1 << bit)
        )

    @staticmethod
    def pack_linear_f32(weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] float32 -> the panel layout of :meth:`linear_f32`:
        [ceil(N / 32), K, 32], columns past N zero."""
        n, k = weight.shape
        panels = -(-n // 32)
        padded = torch.zeros(panels * 32, k, dtype=torch.float32)
        padded[:n] = weight
        return padded.view(panels, 32, k).transpose(1, 2).contiguous()

    @staticmethod
    def pack_linear_bf16(weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] bfloat16 (K even) -> the layout of :meth:`linear_bf16`:
        [ceil(N / 32), K / 2, 32, 2] (each column's k pairs adjacent), columns past N
        zero."""
        n, k = weight.shape
        if k % 2:
            raise ValueError(f"linear_bf16 needs an even input size, got {k}")
        panels = -(-n // 32)
        padded = torch.zeros(panels * 32, k, dtype=torch.bfloat16)
        padded[:n] = weight
        return padded.view(panels, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def linear_bf16(
        self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W^T + bias`` for bfloat16 x [M, K] (last dim contiguous), ``panels``
        from :meth:`pack_linear_bf16` of W [n, K], ``bias`` fp32 padded to
        ``panels.shape[0] * 32`` or None -> bfloat16 [M, n] (fp32 sums, rounded once).

        Rule: ``linear_bf16_available`` holds (else RuntimeError). Made for a few rows
        (decode at batch 1-4), where oneDNN's AMX kernels read the weights slower.
        """
        return self._panel_linear(self._linear_bf16, x, panels, n, bias, torch.bfloat16)

    def linear_bf16_amx(
        self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`linear_bf16` on AMX tiles, the same packed panels and result.

        Rules: ``linear_bf16_amx_available`` holds and K is a multiple of 32 (else
        RuntimeError). Made for 5-32 rows (batched decode), where it streams the
        weights about 1.7x as fast as oneDNN's AMX GEMM on this kind of CPU.
        """
        return self._panel_linear(self._linear_bf16_amx, x, panels, n, bias, torch.bfloat16)

    def linear_f32(
        self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W^T + bias`` for float32 x [M, K] (last dim contiguous), ``panels`` from
        :meth:`pack_linear_f32` of W [n, K], bias [n] contiguous or None -> [M, n].

        Rule: ``linear_f32_available`` holds (else RuntimeError). Made for M up to a
        few dozen rows, where it streams each weight panel once (see linear_panels.cpp).
        """
        return self._panel_linear(self._linear_f32, x, panels, n, bias, torch.float32)

    @staticmethod
    def _panel_linear(
        fn: Any,
        x: torch.Tensor,
        panels: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Call a ``kvs_linear_*`` kernel (shared C signature) into a new [M, n] tensor."""
        rows, k = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(rows, n, dtype=dtype)
        rc = fn(
            x.data_ptr(),
            x.stride(0),
            rows,
            k,
            panels.data_ptr(),
            n,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"{fn.__name__} returned {rc}")
        return out

    def amx_prefill_supports(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """Whether :meth:`prefill_attention_amx` runs for this dtype and shape here: a
        build and CPU with AMX-BF16, bfloat16, head_dim 64, block_size a multiple of 16,
        and ``KVSERVE_PREFILL_AMX`` not set to ``0``."""
        return (
            self.amx_available
            and dtype == torch.bfloat16
            and head_dim == 64
            and block_size % 16 == 0
            and os.environ.get(AMX_ENV_VAR, "1") != "0"
        )

    def prefill_attention_amx(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        seqs: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        row_map: torch.Tensor | None = None,
        merge: bool = False,
    ) -> None:
        """Rows attend to their keys in the pages on AMX tiles (see ``prefill_amx.cpp``).

        Writes the rows of ``seqs`` into ``out`` [T, H, D] (contiguous bfloat16), padding
        rows zero. Rules: :meth:`amx_prefill_supports` holds; q [T, H, D] bfloat16 (last
        dim contiguous); the chunk's K/V are already in ``kv_cache``; ``seqs`` [S, 5]
        int64 rows (row_start, num_rows, num_tokens, cached_seq_len, prior_only): row j
        attends to ``[0, cached_seq_len + j]``, or to ``[0, cached_seq_len)`` with
        prior_only 1; ``block_tables`` [S, max_blocks] int64 covering those keys;
        ``lse`` optional fp32 [T, H]; ``row_map`` optional int64: token j of a seq is
        batch row ``row_map[row_start + j]``; ``merge``: ``out``/``lse`` (required)
        already hold another part of those rows' attention, merged exactly. The kernel
        does not check bounds.
        """
        _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        rc = self._amx(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            out.data_ptr(),
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            q.shape[1],
            num_kv_heads,
            head_dim,
            seqs.data_ptr(),
            seqs.shape[0],
            block_tables.data_ptr(),
            block_tables.shape[1],
            scale,
            torch.get_num_threads(),
            None if lse is None else lse.data_ptr(),
            None if row_map is None else row_map.data_ptr(),
            int(merge),
        )
        if rc != 0:
            raise RuntimeError(f"kvs_prefill_attention_amx returned {rc}")

    def vec_prefill_supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether :meth:`prefill_attention_vec` runs here for this dtype and head_dim
        (32, 64 or 128; float32 or bfloat16; an AVX2 or AVX-512 CPU) with
        ``KVSERVE_PREFILL_VEC`` not ``0`` (a forced variant must be usable)."""
        env = os.environ.get(VEC_ENV_VAR, "1")
        if env == "0" or dtype not in _DTYPES or head_dim not in (32, 64, 128):
            return False
        if env in PREFILL_VEC_ISAS:
            return env in self.prefill_vec_isas and (env != "avx512bf16" or dtype == torch.bfloat16)
        return bool(self.prefill_vec_isas)

    def prefill_attention_vec(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        seqs: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        row_map: torch.Tensor | None = None,
        merge: bool = False,
        isa: str | None = None,
    ) -> None:
        """:meth:`prefill_attention_amx`'s contract on AVX-512/AVX2 (``prefill_vec.cpp``),
        for float32 or bfloat16 (q, out and kv_cache share the dtype).

        Rules: :meth:`vec_prefill_supports` holds for q's dtype and head_dim; any
        block_size. ``isa``: None = ``KVSERVE_PREFILL_VEC`` if it names a variant,
        else the best usable one (vdpbf16ps for bfloat16 on AMD CPUs that have it,
        where it was measured at the fp32 FMA rate; fp32 FMAs otherwise); or one of
        ``PREFILL_VEC_ISAS`` (RuntimeError where unusable). A row's result does not
        depend on the other rows of the call (see the source).
        """
        name = isa if isa is not None else os.environ.get(VEC_ENV_VAR, "1")
        code = PREFILL_VEC_ISAS.get(name, 0)
        _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        rc = self._vec(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            out.data_ptr(),
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            q.shape[1],
            num_kv_heads,
            head_dim,
            seqs.data_ptr(),
            seqs.shape[0],
            block_tables.data_ptr(),
            block_tables.shape[1],
            scale,
            _DTYPES[q.dtype],
            code,
            torch.get_num_threads(),
            None if lse is None else lse.data_ptr(),
            None if row_map is None else row_map.data_ptr(),
            int(merge),
        )
        if rc != 0:
            raise RuntimeError(f"kvs_prefill_attention_vec returned {rc} (isa {name!r})")

    def softmax_rows(self, logits: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
        """``softmax(logits * inv_temperature[:, None], -1)``; contiguous fp32 [B, V] CPU.

        ``inv_temperature`` fp32 [B], every entry > 0.
        """
        rows, cols = logits.shape
        inv_temperature = inv_temperature.to(torch.float32).contiguous()
        out = torch.empty(rows, cols, dtype=torch.float32)
        self._softmax(
            logits.data_ptr(),
            rows,
            cols,
            inv_temperature.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def sample_rows(
        self, probs: torch.Tensor, threshold: torch.Tensor, uniforms: torch.Tensor
    ) -> torch.Tensor:
        """Inverse-CDF token per row over the tokens with ``probs >= threshold`` ([B]).

        probs: contiguous fp32 [B, V] CPU (unnormalized, >= 0); threshold fp32 [B];
        uniforms float64 [B] in [0, 1). Same rule as ``_inverse_cdf_sample`` on probs
        with the tail below the threshold zeroed.
        """
        rows, cols = probs.shape
        threshold = threshold.to(torch.float32).contiguous()
        uniforms = uniforms.to(torch.float64).contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        self._sample(
            probs.data_ptr(),
            rows,
            cols,
            threshold.data_ptr(),
            uniforms.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(-1)`` for a contiguous fp32 [rows, cols] CPU tensor (rows >= 1)."""
        rows, cols = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax(x.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads())
        return out

    def top_p_threshold(self, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Smallest kept probability per row of the nucleus (0 where ``top_p >= 1``).

        probs: contiguous fp32 [rows, cols] CPU tensor; top_p: fp32 [rows]. Same rule
        as :func:`kvserve.worker.sampler._apply_top_p` (sums in double, so a token
        within float rounding of the boundary may fall on the other side).
        """
        rows, cols = probs.shape
        top_p = top_p.to(torch.float32).contiguous()
        out = torch.empty(rows, dtype=torch.float32)
        self._top_p(
            probs.data_ptr(), rows, cols, top_p.data_ptr(), out.data_ptr(), torch.get_num_threads()
        )
        return out

    def add_rms_norm(
        self,
        residual: torch.Tensor,
        x: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """``residual += x`` (in place, fp32) then RMSNorm of it times ``weight``.

        residual [T, hidden] fp32 contiguous; x [T, hidden] (rows may be strided, last
        dim contiguous) and weight [hidden] in the model dtype (float32/bfloat16).
        Returns the normed rows [T, hidden] in the model dtype.
        """
        rows, hidden = residual.shape
        out = torch.empty(rows, hidden, dtype=weight.dtype)
        rc = self._norm(
            residual.data_ptr(),
            None if x is None else x.data_ptr(),
            0 if x is None else x.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
            _DTYPES[weight.dtype],
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"kvs_add_rms_norm returned {rc}")
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] contiguous -> silu(gate) * up [T, I], same dtype."""
        rows, two_i = gate_up.shape
        out = torch.empty(rows, two_i // 2, dtype=gate_up.dtype)
        rc = self._silu(
            gate_up.data_ptr(),
            out.data_ptr(),
            rows,
            two_i // 2,
            _DTYPES[gate_up.dtype],
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"kvs_silu_mul returned {rc}")
        return out

    def rope_and_cache(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """RoPE on q and k of ``qkv`` [T, (H + 2Hk) * D] in place; K/V rows to their slots.

        Rules: ``qkv`` contiguous rows; positions [T] int64 below ``cos.shape[0]``;
        cos/sin [max_pos, D/2] fp32 contiguous; kv_cache [2, Hk, blocks, block_size, D]
        contiguous in qkv's dtype; slot_mapping [T] int64, -1 = not written.
        """
        rc = self._rope(
            qkv.data_ptr(),
            qkv.stride(0),
            qkv.shape[0],
            num_heads,
            num_kv_heads,
            head_dim,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            kv_cache.data_ptr(),
            kv_cache.shape[2] * kv_cache.shape[3],
            slot_mapping.data_ptr(),
            _DTYPES[qkv.dtype],
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"kvs_rope_and_cache returned {rc}")

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
        lse: torch.Tensor | None = None,
        row_map: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, D] (last dim contiguous) -> out [T, H, D].

        Rules: ``kv_cache`` [2, Hk, blocks, block_size, D] contiguous in q's dtype (one
        of float32/bfloat16), on the CPU; ``seqs`` [S, 5] int64 contiguous rows of
        (row_start, num_rows, num_tokens, cached_seq_len, prior_only) covering
        ``[0, T)``; ``block_tables`` [S, max_blocks] int64 contiguous with valid block
        ids for every visible position; ``lse`` (optional) fp32 [T, H] contiguous,
        receives each row's log-sum-exp (padding rows are left as they are).
        ``row_map`` (optional int64): token j of a seq is batch row
        ``row_map[row_start + j]``. ``out`` (optional, contiguous [T, H, D]): merge
        into it; it and ``lse`` must already hold another part of the attention of
        every row of ``seqs`` (or lse -inf), which is merged exactly; without it a new
        tensor is returned. The kernel does not check bounds.
        """
        num_tokens, num_heads, head_dim = q.shape
        _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
        merge = out is not None
        if merge and lse is None:
            raise ValueError("merging into out needs the lse of what it holds")
        if out is None:
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
            None if lse is None else lse.data_ptr(),
            None if row_map is None else row_map.data_ptr(),
            int(merge),
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


@torch.library.custom_op("kvserve::paged_attention", mutates_args=())
def paged_attention_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seqs: torch.Tensor,
    block_tables: torch.Tensor,
    kv_segment_size: int,
    scale: float,
) -> torch.Tensor:
    """The native kernel as a PyTorch operator, so ``torch.compile`` keeps it opaque.

    Same contract as :meth:`PagedAttentionKernel.__call__`; raises RuntimeError where
    the kernel is unavailable (callers choose the backend first).
    """
    kernel = get_kernel()
    if kernel is None:
        raise RuntimeError("native paged attention is unavailable (see kvserve.model.native)")
    if q.stride(-1) != 1:
        q = q.contiguous()
    return kernel(q, kv_cache, seqs, block_tables, kv_segment_size, scale)


@paged_attention_op.register_fake
def _(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seqs: torch.Tensor,
    block_tables: torch.Tensor,
    kv_segment_size: int,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op("kvserve::write_kv_and_attend", mutates_args=("kv_cache",))
def write_kv_and_attend_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    write_slots: torch.Tensor,
    seqs: torch.Tensor,
    block_tables: torch.Tensor,
    kv_segment_size: int,
    scale: float,
) -> torch.Tensor:
    """Write the step's K/V [T, Hk, D] to ``write_slots`` [T] of ``kv_cache`` (in place),
    then :func:`paged_attention_op`. One operator, so that a compiled graph mutates the
    cache where it lies: an in-place write followed by a separate read made inductor
    copy each layer's whole cache twice per step."""
    flat = kv_cache.view(2, kv_cache.shape[1], -1, kv_cache.shape[-1])  # [2, Hk, slots, D]
    flat[0].index_copy_(1, write_slots, k.transpose(0, 1))
    flat[1].index_copy_(1, write_slots, v.transpose(0, 1))
    return paged_attention_op(q, kv_cache, seqs, block_tables, kv_segment_size, scale)


@write_kv_and_attend_op.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    write_slots: torch.Tensor,
    seqs: torch.Tensor,
    block_tables: torch.Tensor,
    kv_segment_size: int,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)
