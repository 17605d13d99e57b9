"""Every ``KVSERVE_*`` environment switch: name, default and meaning, in one table.

Every switch the code reads (Python or C++) is in :data:`SWITCHES`; docs/configuration.md
lists the same table with the command-line flags. ``tests/test_configuration.py``
checks that the code names no switch missing here, that each one here is read, and
that the docs name them all. Command-line flags and ``LLM(...)`` options are the
configuration proper (:mod:`kvserve.engine.args`, :mod:`kvserve.entrypoints.serve_args`);
switches are for kernels and diagnostics, and for what kvserve hands its own child
processes (``internal``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    name: str
    default: str  # what an unset variable means
    meaning: str
    read: str  # where and when it is read
    internal: bool = False  # set by kvserve for a child process, not by users


_PORTABLE = "``portable``: {what} off (the PyTorch path); ``native`` or unset: on"

SWITCHES: tuple[Switch, ...] = (
    Switch(
        "KVSERVE_API_KEY",
        "unset",
        "the bearer key ``kvserve serve`` requires when ``--api-key`` is not given; "
        "also the benchmark client's key",
        "at server start",
    ),
    Switch(
        "KVSERVE_CACHE_DIR",
        "``~/.cache/kvserve``",
        "root of kvserve's caches: converted models, packed weights, compiled kernels, "
        "step-time fits, compiled graphs",
        "at each use",
    ),
    Switch(
        "KVSERVE_KERNELS",
        "``native``",
        _PORTABLE.format(what="every native kernel family (LoRA ops included)"),
        "when a model is prepared",
    ),
    Switch(
        "KVSERVE_ATTENTION",
        "``native``",
        _PORTABLE.format(what="paged attention (decode and prefill kernels)"),
        "when a model is prepared",
    ),
    Switch(
        "KVSERVE_LINEAR",
        "``native``",
        _PORTABLE.format(what="the float panel linears"),
        "when a model is prepared",
    ),
    Switch(
        "KVSERVE_QUANT_LINEAR",
        "``native``",
        _PORTABLE.format(what="the quantized-weight kernels"),
        "when a model is prepared",
    ),
    Switch(
        "KVSERVE_SAMPLING",
        "``native``",
        _PORTABLE.format(what="the sampling kernels"),
        "when a model is prepared",
    ),
    Switch(
        "KVSERVE_NORMS",
        "``native``",
        _PORTABLE.format(what="fused add+RMSNorm, RoPE+KV write and SiLU*mul"),
        "when a model is prepared",
    ),
    Switch(
        "KVSERVE_LORA",
        "``native``",
        _PORTABLE.format(what="the LoRA kernels"),
        "when the LoRA ops load",
    ),
    Switch(
        "KVSERVE_PREFILL_AMX",
        "``1``",
        "``0``: prefill chunks never take the AMX attention kernel",
        "at each step",
    ),
    Switch(
        "KVSERVE_PREFILL_VEC",
        "``1``",
        "``0``: prefill chunks never take the vector attention kernel; ``avx2``, "
        "``avx512``, ``avx512bf16``: force that variant (where usable)",
        "at each step",
    ),
    Switch(
        "KVSERVE_KV8_ISA",
        "``auto``",
        "the 8-bit KV attention kernel: ``portable`` (scalar reference) or ``avx512``",
        "at each call",
    ),
    Switch(
        "KVSERVE_BF16_DOT",
        "unset (``vdpbf16ps`` on AMD CPUs with AVX512_BF16, FMA elsewhere)",
        "``fma`` or ``dp``: the bf16 dot product of the paged and vector attention kernels",
        "once per process (C++)",
    ),
    Switch(
        "KVSERVE_FUSED_DECODE",
        "``1``",
        "``0``: decode steps run the per-layer loop, not the one-call fused step",
        "when a model is prepared",
    ),
    Switch(
        "KVSERVE_HUGEPAGES",
        "``1``",
        "``0``: no ``MADV_HUGEPAGE`` advice for the KV pool",
        "at each allocation",
    ),
    Switch(
        "KVSERVE_PACKED_CACHE",
        "``1``",
        "``0``: no packed-weight cache (every load repacks)",
        "at each load",
    ),
    Switch(
        "KVSERVE_MALLOPT",
        "``1``",
        "``0``: leave glibc's allocator thresholds alone",
        "at process start",
    ),
    Switch(
        "KVSERVE_NO_MINCORE",
        "unset",
        "set: resident-memory reports skip ``mincore`` (they report nothing)",
        "at each report",
    ),
    Switch(
        "KVSERVE_LOCAL_CLUSTER",
        "unset",
        "``1``: a ``--replicas`` replica binds Ray Serve's gRPC server to 127.0.0.1",
        "in each replica",
        internal=True,
    ),
    Switch(
        "KVSERVE_COMPILE_MEMORY_BYTES",
        "``0`` (no cap)",
        "the grammar-compile worker's address-space cap",
        "in the worker",
        internal=True,
    ),
    Switch(
        "KVSERVE_COMPILE_STACK_BYTES",
        "64 MiB",
        "the grammar-compile worker's thread stack",
        "in the worker",
        internal=True,
    ),
    Switch(
        "KVSERVE_RENDER_MEMORY_BYTES",
        "``0`` (no cap)",
        "the chat-template render worker's address-space cap",
        "in the worker",
        internal=True,
    ),
)

BY_NAME = {s.name: s for s in SWITCHES}
