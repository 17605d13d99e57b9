"""``QuantLinear``: a linear layer over quantized weights, behind the same seam as
:class:`~kvserve.model.linear.FastLinear` (call it with x [M, K]; compiled graphs see
one opaque ``kvserve::fast_linear`` operator)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from kvserve.model import linear as _linear
from kvserve.model.quant.formats import QuantWeight, reference_linear
from kvserve.model.quant.kernel import K_CODES, QuantKernel

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class QuantLinear:
    """``y = x @ W^T + b`` with W given as one or more row blocks (``parts``, e.g. a
    fused qkv whose q, k and v came in different formats), each a :class:`QuantWeight`.

    With ``kernel`` (the native library) every M runs ``kvs_linear_quant`` (int8
    activations, VNNI dot products): one reduction order per row, so a row's result
    does not depend on the other rows of the step. Without it the PyTorch reference
    runs (same arithmetic, fp64 sums). Output dtype = x's dtype.
    """

    __slots__ = (
        "__weakref__",
        "_fast",
        "_fast_silu",
        "bias",
        "handle",
        "invariant",
        "kernel",
        "n",
        "offsets",
        "parts",
    )

    @property
    def invariant_capable(self) -> bool:
        """Whether a row's result is independent of M (the native kernel; the portable
        reference's fp64 sums are per row too, but its dequantization may differ by M)."""
        return self.kernel is not None

    def __init__(
        self,
        parts: list[QuantWeight],
        bias: torch.Tensor | None,
        kernel: QuantKernel | None,
    ) -> None:
        if not parts or any(p.k != parts[0].k for p in parts):
            raise ValueError("QuantLinear needs parts with one input size")
        self.parts = parts
        self.offsets = []
        n = 0
        for p in parts:
            self.offsets.append(n)
            n += p.n
        self.n = n
        self.bias = None if bias is None else bias.float().contiguous()
        self.kernel = kernel
        # Batch-invariant mode (llama.set_batch_invariant) needs nothing here: every M
        # already runs the one native reduction order. The flag is kept for the caller.
        self.invariant = False
        # one native call with the arguments bound (the decode path's per-call cost)
        one = kernel is not None and len(parts) == 1
        self._fast = kernel.bind(parts[0], self.bias) if one and kernel is not None else None
        silu = one and kernel is not None and n % 32 == 0 and parts[0].fmt.code < K_CODES
        self._fast_silu = (
            kernel.bind(parts[0], self.bias, silu=True) if silu and kernel is not None else None
        )
        perm = parts[0].in_perm if one else None
        if perm is not None:  # act-order weights (quant/hf_int4.py): gather the inputs
            self._fast = _gathered(self._fast, perm)
            self._fast_silu = _gathered(self._fast_silu, perm)
        self.handle = next(_linear._handles)
        _linear._LINEARS[self.handle] = self

    @property
    def out_features(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.kvserve.fast_linear(x, self.handle, self.n)
        return self.eager(x)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32/bfloat16 -> [M, n] in x's dtype."""
        if self._fast is not None and x.dtype in _NATIVE_DTYPES:
            return self._fast(x)
        if self.kernel is None or x.dtype not in _NATIVE_DTYPES:
            out = torch.cat([reference_linear(x, p) for p in self.parts], 1)
            if self.bias is not None:
                out = out + self.bias
            return out.to(x.dtype)
        if len(self.parts) == 1:
            return self.kernel.linear(_inputs(x, self.parts[0]), self.parts[0], self.bias)
        out = torch.empty(x.shape[0], self.n, dtype=x.dtype)
        for p, off in zip(self.parts, self.offsets, strict=True):
            b = None if self.bias is None else self.bias[off : off + p.n]
            self.kernel.linear(_inputs(x, p), p, b, out=out[:, off : off + p.n])
        return out

    @property
    def native_one_part(self) -> bool:
        """Whether float32/bfloat16 inputs run one native call on one part (the weight
        ``parts[0]``, bias ``bias``): what the fused decode step calls directly."""
        return self._fast is not None

    @property
    def fused_silu_capable(self) -> bool:
        """Whether :meth:`silu_mul` runs as one native call (one part, n % 32 == 0)."""
        return self._fast_silu is not None

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """For a fused gate_up layer (first n/2 outputs the gate): ``silu(g) * u`` [M, n/2]
        in x's dtype, the values of ``kvs_silu_mul(self(x))`` (the native SiLU of
        csrc/fused_ops.cpp on the linear's rounded output), in one pass over W where
        :attr:`fused_silu_capable`; otherwise the linear, then PyTorch's SiLU."""
        if self._fast_silu is not None and x.dtype in _NATIVE_DTYPES:
            return self._fast_silu(x)
        gate, up = self.eager(x).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def _inputs(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x's columns in w's stored input order."""
    return x if w.in_perm is None else x.index_select(1, w.in_perm)


def _gathered(
    fn: Callable[[torch.Tensor], torch.Tensor] | None, perm: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if fn is None:
        return None
    return lambda x: fn(x.index_select(1, perm))


class QuantEmbedding:
    """Rows of a quantized [vocab, hidden] table (one or more row blocks), dequantized
    to ``dtype``; one opaque ``kvserve::quant_embed`` operator in compiled graphs."""

    __slots__ = ("__weakref__", "dtype", "handle", "kernel", "parts")

    def __init__(
        self, parts: list[QuantWeight], dtype: torch.dtype, kernel: QuantKernel | None
    ) -> None:
        self.parts = parts
        self.dtype = dtype
        self.kernel = kernel
        self.handle = next(_linear._handles)
        _EMBEDDINGS[self.handle] = self

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.kvserve.quant_embed(ids, self.handle, self.parts[0].k)
        return self.eager(ids)

    def eager(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 in [0, vocab) -> [T, hidden] in ``dtype``."""
        native = self.kernel is not None and self.dtype in (torch.float32, torch.bfloat16)
        native = native and self.parts[0].in_perm is None
        if native and len(self.parts) == 1:
            assert self.kernel is not None
            return self.kernel.embed(self.parts[0], ids, self.dtype)
        full = torch.cat([q.dequantize() for q in self.parts])  # the portable reference
        return torch.nn.functional.embedding(ids, full).to(self.dtype)


_EMBEDDINGS: weakref.WeakValueDictionary[int, QuantEmbedding] = weakref.WeakValueDictionary()


@torch.library.custom_op("kvserve::quant_embed", mutates_args=())
def quant_embed_op(ids: torch.Tensor, handle: int, hidden: int) -> torch.Tensor:
    """``QuantEmbedding`` number ``handle`` as an operator compiled graphs keep opaque.
    Rule: the embedding is alive."""
    return _EMBEDDINGS[handle].eager(ids)


@quant_embed_op.register_fake
def _(ids: torch.Tensor, handle: int, hidden: int) -> torch.Tensor:
    return ids.new_empty(ids.shape[0], hidden, dtype=_EMBEDDINGS[handle].dtype)
