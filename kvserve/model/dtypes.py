"""Model dtypes by name, and ``dtype="auto"``: bfloat16 where the CPU has native bf16."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes in bfloat16 natively (``avx512_bf16`` or ``amx_bf16``).

    ``cpuinfo`` is the text of ``/proc/cpuinfo`` (read when None; False where absent).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def parse_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """``"auto"``/``"float32"``/``"bfloat16"``/``"float16"`` (or a torch dtype) -> torch dtype.

    ``"auto"`` is bfloat16 on a CPU with native bf16 (:func:`cpu_has_native_bf16`) and
    float32 otherwise (and on any other device).
    """
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype == "auto":
        native = torch.device(device).type == "cpu" and cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(
        f"unsupported dtype {dtype!r}: use one of auto, float32, bfloat16, float16 "
        f"(for example: dtype='float32')"
    )
