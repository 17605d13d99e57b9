"""The kernel backend: which native kernel families a process uses, chosen once.

:class:`KernelBackend` holds one binding per family (None = that family runs its
portable PyTorch path). The model runner chooses it (:func:`default_backend`, from the
environment, when the model is prepared) and passes it down: the model keeps it
(``model.kernels``), the runner hands it to the attention metadata builder
(``build_attention_metadata(kernels=...)``) and to the sampler. The switches, read once
per process (see docs/kernels.md for the table):

=========================  ==================================================================
``KVSERVE_KERNELS``        ``portable``: every family off
``KVSERVE_ATTENTION``      ``portable``: paged attention (decode and prefill kernels) off
``KVSERVE_LINEAR``         ``portable``: the panel linears off (oneDNN/PyTorch matmuls)
``KVSERVE_QUANT_LINEAR``   ``portable``: the quantized-weight kernels off (PyTorch reference)
``KVSERVE_SAMPLING``       ``portable``: the sampling kernels off (PyTorch ops)
``KVSERVE_NORMS``          ``portable``: the fused add+RMSNorm, RoPE+KV write, SiLU*mul off
                           (then the layers run as PyTorch ops around native attention)
=========================  ==================================================================

Two per-step switches are read at each use: ``KVSERVE_PREFILL_AMX=0`` and
``KVSERVE_PREFILL_VEC`` (see :mod:`~kvserve.model.kernels.prefill_amx`,
:mod:`~kvserve.model.kernels.prefill_vec`). Where the library does not build (no
compiler), every family is None and a warning is logged once.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvserve.model.kernels.build import load_library
from kvserve.model.kernels.fused_ops import FusedOps
from kvserve.model.kernels.linear_panels import LinearPanels
from kvserve.model.kernels.paged_attention import PagedAttention
from kvserve.model.kernels.prefill_amx import PrefillAmx
from kvserve.model.kernels.prefill_vec import PrefillVec
from kvserve.model.kernels.sampling import Sampling
from kvserve.model.quant.kernel import QuantKernel, load_quant_kernel

logger = logging.getLogger(__name__)

ALL_ENV_VAR = "KVSERVE_KERNELS"
# family -> its switch; "portable" turns it off ("native", the default, keeps it on)
FAMILY_ENV_VARS = {
    "attention": "KVSERVE_ATTENTION",
    "linear": "KVSERVE_LINEAR",
    "quant_linear": "KVSERVE_QUANT_LINEAR",
    "sampling": "KVSERVE_SAMPLING",
    "norms": "KVSERVE_NORMS",
}
_VALUES = ("native", "portable")


@dataclass(frozen=True)
class KernelBackend:
    """One binding per kernel family, or None where it runs the portable path.

    ``attention``: paged attention of any rows; ``prefill_amx`` / ``prefill_vec``: the
    prefill attention kernels (on with ``attention``); ``norms``: fused layer ops;
    ``linear``: panel linears; ``quant_linear``: the quantized-weight kernels
    (:class:`~kvserve.model.quant.kernel.QuantKernel`); ``sampling``: the sampler's
    row kernels. ``library``: the built library's path (None when none is loaded).
    """

    attention: PagedAttention | None = None
    prefill_amx: PrefillAmx | None = None
    prefill_vec: PrefillVec | None = None
    norms: FusedOps | None = None
    linear: LinearPanels | None = None
    quant_linear: QuantKernel | None = None
    sampling: Sampling | None = None
    library: Path | None = None

    @classmethod
    def portable(cls) -> KernelBackend:
        """Every family on its PyTorch path."""
        return cls()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KernelBackend:
        """The families the switches leave on (``env`` defaults to ``os.environ``).

        Raises ValueError for a switch set to anything but ``native``/``portable``.
        Builds the library on first use; where that fails, logs once and returns
        :meth:`portable`.
        """
        env = os.environ if env is None else env
        on = {}
        everything = _switch(env, ALL_ENV_VAR)
        for family, var in FAMILY_ENV_VARS.items():
            on[family] = everything and _switch(env, var)
        if not any(on.values()):
            return cls.portable()
        try:
            path, lib = load_library()
        except (RuntimeError, OSError) as e:
            _warn_once(str(e))
            return cls.portable()
        quant = load_quant_kernel(path) if on["quant_linear"] else None
        return cls(
            attention=PagedAttention(lib) if on["attention"] else None,
            prefill_amx=PrefillAmx(lib) if on["attention"] else None,
            prefill_vec=PrefillVec(lib) if on["attention"] else None,
            norms=FusedOps(lib) if on["norms"] else None,
            linear=LinearPanels(lib) if on["linear"] else None,
            quant_linear=quant,
            sampling=Sampling(lib) if on["sampling"] else None,
            library=path,
        )

    def families(self) -> dict[str, bool]:
        """Which families are native, by the names of :data:`FAMILY_ENV_VARS`."""
        return {f: getattr(self, f) is not None for f in FAMILY_ENV_VARS}


def _switch(env: Mapping[str, str], var: str) -> bool:
    value = env.get(var, "native")
    if value not in _VALUES:
        raise ValueError(f"{var}={value!r}: use 'native' or 'portable'")
    return value == "native"


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("native kernels unavailable, using the portable paths: %s", reason)


_DEFAULT: dict[tuple[tuple[str, str], ...], KernelBackend] = {}


def default_backend() -> KernelBackend:
    """The backend the switches in ``os.environ`` choose, made once per distinct
    setting of them (so tests that flip a switch get the matching backend)."""
    key = tuple((v, os.environ.get(v, "native")) for v in (ALL_ENV_VAR, *FAMILY_ENV_VARS.values()))
    backend = _DEFAULT.get(key)
    if backend is None:
        backend = _DEFAULT[key] = KernelBackend.from_env()
    return backend
