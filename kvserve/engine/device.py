"""``--device``: which torch device the engine runs on, checked before the model loads.

    auto   (the default) the device kvserve's kernels are built for on this host: cpu
    cpu    the CPU
    cuda, cuda:N, mps, ...  accepted only when torch can use it on this host

Rules a caller must keep: call :func:`resolve_device` before loading anything; it
returns the device string to use or raises ValueError with one line that says what
is wrong and what to pass instead (``kvserve serve`` prints it and exits 2).
"""

from __future__ import annotations

DEVICES_HELP = "auto (default: cpu, the device kvserve's kernels run on), cpu, cuda[:N]"


def resolve_device(value: str | None) -> str:
    """The torch device string for ``value`` (see the module docstring)."""
    name = (value or "auto").strip().lower()
    if name in ("auto", "cpu"):
        return "cpu"
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"invalid --device {value!r}: use one of {DEVICES_HELP}") from None
    kind = device.type
    usable = True
    if kind == "cuda":
        usable = bool(torch.cuda.is_available())
        if usable and device.index is not None and device.index >= torch.cuda.device_count():
            usable = False
    elif kind == "mps":
        backend = getattr(torch.backends, "mps", None)
        usable = bool(backend is not None and backend.is_available())
    elif kind != "cpu":
        usable = False
    if not usable:
        raise ValueError(
            f"--device {value}: this host has no usable {kind} device (torch sees none); "
            "kvserve runs on CPU: use --device cpu or --device auto (the default)"
        )
    return name
