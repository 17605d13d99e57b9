"""CPU linear layers: the fastest kernel per batch size, chosen once at load."""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvserve.model.kernels.linear_panels import LinearPanels

# Rows up to which ``x @ W^T`` runs on a [K, N] copy of the weight (a streaming
# vector-matrix product: about 2x faster than MKL's gemv for decode at batch 1-2).
_SMALL_M = 2
# float32 rows up to which the native panel kernel runs (``linear_panels.cpp``): 1.3-1.6x
# oneDNN's prepacked GEMM from 8 to 32 rows (30 layers' weights, out of cache), even
# at 64 rows, and as fast as the [K, N] product at 1-2 rows.
NATIVE_F32_MAX_M = 32
# bfloat16 rows up to which the native panel kernel (AVX512-BF16 dot products) runs
# where AMX tiles can take over: 1.5-2x oneDNN's prepacked AMX GEMM at 1-4 rows. Past it
# the same panels run on AMX tiles (``kvs_linear_bf16_amx``, K a multiple of 32) at every
# M: 1.5-2.5x oneDNN's AMX GEMM at 8-16 rows, 1.3-1.9x at 32, and level with it from 64 on
# (L2-sized panel groups). Without AMX the AVX512-BF16 panels run at every M (level with
# oneDNN's AVX512-BF16 GEMM at 128-512 rows), so bfloat16 weights need no oneDNN copy.
NATIVE_BF16_MAX_M = 4


def mkldnn_linear_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacked linears run and agree with ``F.linear`` here (a small probe)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 32, generator=gen).to(dtype)
        x = torch.randn(5, 32, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return torch.allclose(got.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)


class FastLinear:
    """``y = x @ W^T + b`` for x [M, K], W [N, K], with the fastest CPU kernel per M.

    - float32 with the native kernel (``native`` given, AVX-512), ``M <=
      NATIVE_F32_MAX_M`` (decode): the native panel kernel on a packed copy;
    - bfloat16 with the native kernel (AVX512-BF16, even K): the native bfloat16 panel
      kernel up to ``NATIVE_BF16_MAX_M`` rows, and past that the same panels on AMX
      tiles where the CPU has AMX-BF16 and K is a multiple of 32, else the AVX512-BF16
      panels, at every M. bfloat16 with panels keeps *only* the panels (``weight`` is
      None, no oneDNN copy), so its weights are resident once;
    - float32 without it, ``M <= 2``: ``x @ wt`` on a contiguous [K, N] copy;
    - otherwise (bfloat16 without panels, float32 prefill and batched decode): oneDNN
      with a prepacked weight (about 1.5x MKL's sgemm for float32, and 1.6x
      ``F.linear`` for bfloat16 even at M = 1, on this kind of CPU), falling back to
      ``F.linear``.

    ``fast=False`` (or a non-CPU device) keeps plain ``F.linear``. ``weight`` stays a
    valid [N, K] tensor (a view of ``wt`` when there is one) except for bfloat16 panels,
    where it is None and :meth:`dense` rebuilds the [N, K] matrix from the panels.
    Rule for the caller: once ``weight`` is None, drop its own reference to the dense
    tensor too (or the weights stay resident twice).

    ``invariant`` (batch-invariant mode, see docs/determinism.md): the native panel
    kernel of the weight's dtype at *every* M (never AMX tiles, oneDNN or MKL), so a
    row's result is bitwise the same whatever other rows share the call: each output
    is one fp32 sum over k in order, rounded once, whichever 8-row block holds the
    row. Rule: only set it where ``panels`` exists (``invariant_capable``).
    """

    __slots__ = (
        "__weakref__",
        "amx",
        "bias",
        "handle",
        "invariant",
        "native",
        "out_features",
        "packed",
        "panel_bias",
        "panels",
        "weight",
        "wt",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        fast: bool,
        pack: bool = False,
        native: LinearPanels | None = None,
    ) -> None:
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.out_features = int(weight.shape[0])
        self.handle = next(_handles)  # how compiled graphs name it (``kvserve::fast_linear``)
        _LINEARS[self.handle] = self
        self.wt: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        self.panel_bias: torch.Tensor | None = None  # fp32, padded (bfloat16 panels)
        self.native = native
        self.amx = False  # whether the bfloat16 panels may run on AMX tiles
        self.invariant = False  # panels at every M (batch-invariant mode)
        if fast and weight.device.type == "cpu":
            if pack:  # the caller checked mkldnn_linear_works(weight.dtype)
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            f32 = weight.dtype == torch.float32
            if f32 and native is not None and native.linear_f32_available:
                self.panels = native.pack_linear_f32(weight)
                if bias is not None:
                    self.bias = bias.contiguous()
            elif (
                weight.dtype == torch.bfloat16
                and weight.shape[1] % 2 == 0
                and native is not None
                and native.linear_bf16_available
            ):
                self.panels = native.pack_linear_bf16(weight)
                if native.linear_bf16_amx_available and weight.shape[1] % 32 == 0:
                    self.amx = True
                if bias is not None:
                    padded = torch.zeros(self.panels.shape[0] * 32)
                    padded[: bias.shape[0]] = bias.float()
                    self.panel_bias = padded
                self.packed = None  # the panels serve every M: one resident copy
                self.weight = None
            if self.panels is None and (f32 or self.packed is None):
                self.wt = weight.t().contiguous()  # [K, N]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque operator in compiled graphs
            return torch.ops.kvserve.fast_linear(x, self.handle, self.out_features)
        return self.eager(x)

    def dense(self) -> torch.Tensor:
        """The [N, K] weight: ``weight`` itself, or unpacked from the bfloat16 panels
        (a new tensor, bitwise the values packed)."""
        if self.weight is not None:
            return self.weight
        assert self.panels is not None
        p = self.panels
        return p.permute(0, 2, 1, 3).reshape(p.shape[0] * 32, p.shape[1] * 2)[: self.out_features]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] of the [N, K] weight -> [T, K] (a tied embedding's lookup
        when only the panels are resident). Rule: ids in ``[0, out_features)``."""
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        assert self.panels is not None
        p = self.panels
        return p[ids // 32, :, ids % 32, :].reshape(ids.shape[0], p.shape[1] * 2)

    @property
    def invariant_capable(self) -> bool:
        """Whether this layer has the native panels that batch-invariant mode runs."""
        return self.panels is not None

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel choice of the class docstring, outside any graph."""
        if self.panels is not None:
            assert self.native is not None
            n = self.out_features
            if self.panels.dtype == torch.float32:
                if self.invariant or x.shape[0] <= NATIVE_F32_MAX_M:
                    return self.native.linear_f32(x, self.panels, n, self.bias)
            elif self.invariant or x.shape[0] <= NATIVE_BF16_MAX_M or not self.amx:
                return self.native.linear_bf16(x, self.panels, n, self.panel_bias)
            else:
                return self.native.linear_bf16_amx(x, self.panels, n, self.panel_bias)
        if self.wt is not None and x.shape[0] <= _SMALL_M:
            if self.bias is None:
                return torch.mm(x, self.wt)
            return torch.addmm(self.bias, x, self.wt)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


_handles = itertools.count()


class _EagerLinear(Protocol):
    def eager(self, x: torch.Tensor) -> torch.Tensor: ...


# FastLinear and QuantLinear (kvserve.model.quant.linear) by handle
_LINEARS: weakref.WeakValueDictionary[int, _EagerLinear] = weakref.WeakValueDictionary()


@torch.library.custom_op("kvserve::fast_linear", mutates_args=())
def fast_linear_op(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """``FastLinear`` number ``handle`` as an operator ``torch.compile`` keeps opaque, so
    compiled graphs use the same prepacked oneDNN and native kernels as eager steps
    (inductor cannot lower a prepacked weight). Rule: the layer is alive."""
    return _LINEARS[handle].eager(x)


@fast_linear_op.register_fake
def _(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)
