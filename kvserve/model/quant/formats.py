"""Quantized weight formats as data, the panel layout of ``csrc/linear_quant.cpp``, and
the PyTorch reference of its arithmetic (what the tests compare the kernels against).

A weight W [n, k] (k a multiple of 32) is stored in blocks of 32 values along k, each
value an unsigned integer ``u`` with a per-block fp16 scale ``d`` and, for formats with
a minimum, an fp16 minimum ``m``::

    symmetric:     w = d * (u - zero)        q4_0 (zero 8), q8_0 (zero 128)
    with minimum:  w = d * u + m             q4_1, u8_min

GGUF's Q4_0, Q4_1 and Q8_0 map onto these exactly (Q8_0's signed q is stored as
``u = q + 128``). The packed layout: columns (rows of W) in panels of 16, each panel
its k/32 blocks in order, each block ``bits * 64`` bytes of values (16 columns x 4
consecutive k per 64-byte chunk; 4-bit values two to a byte: chunk c holds k 4c..4c+3
in the low nibbles and 16+4c.. in the high ones), then d[16] and m[16] as fp16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # values per block along k
PANEL = 16  # columns per panel


@dataclass(frozen=True)
class QuantFormat:
    """One stored weight format. ``code`` is the C kernel's format number."""

    name: str
    code: int
    bits: int  # 4 or 8 bits per stored value
    zero: int  # subtracted from u (symmetric formats)
    has_min: bool  # w = d * u + m instead of d * (u - zero)

    @property
    def block_bytes(self) -> int:
        """Bytes of one 16-column x 32-k block in the panel layout."""
        return self.bits * 64 + 32 + (32 if self.has_min else 0)


Q4_1 = QuantFormat("q4_1", 0, 4, 0, True)
Q4_0 = QuantFormat("q4_0", 1, 4, 8, False)
Q8_0 = QuantFormat("q8_0", 2, 8, 128, False)
U8_MIN = QuantFormat("u8_min", 3, 8, 0, True)
FORMATS: dict[str, QuantFormat] = {f.name: f for f in (Q4_1, Q4_0, Q8_0, U8_MIN)}


@dataclass
class QuantWeight:
    """A quantized weight [n, k] in the panel layout (``data``: flat uint8, CPU).

    ``source`` says where it came from (e.g. ``"gguf:Q4_1"``, ``"int4"``). Rules:
    ``k % 32 == 0``; ``data`` has ``ceil(n / 16) * (k / 32) * fmt.block_bytes`` bytes.
    ``in_perm`` (act-order GPTQ, quant/hf_int4.py): stored column j is input
    ``in_perm[j]``, so the linear runs on ``x[:, in_perm]``; None for the natural order.
    """

    data: torch.Tensor
    fmt: QuantFormat
    n: int
    k: int
    source: str = ""
    in_perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    # ------------------------------------------------------------ pack / unpack

    @classmethod
    def pack(
        cls,
        u: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor | None,
        fmt: QuantFormat,
        source: str = "",
    ) -> QuantWeight:
        """u [n, k] uint8 values (< 2**bits), d [n, k/32] fp16, m like d (formats with a
        minimum) -> the panel layout. Padding columns get d = m = 0 (they compute 0)."""
        n, k = u.shape
        if k % BLOCK:
            raise ValueError(f"quantized weights need k divisible by {BLOCK}, got {k}")
        if (m is None) == fmt.has_min:
            raise ValueError(f"format {fmt.name} {'needs' if fmt.has_min else 'has no'} minimum")
        nb, panels = k // BLOCK, -(-n // PANEL)
        pad = panels * PANEL - n
        u = u.to(torch.uint8)
        if pad:
            u = torch.cat([u, u.new_zeros(pad, k)])
            d = torch.cat([d, d.new_zeros(pad, nb)])
            m = None if m is None else torch.cat([m, m.new_zeros(pad, nb)])
        uq = u.view(panels, PANEL, nb, BLOCK).permute(0, 2, 1, 3)  # [P, nb, 16, 32]
        if fmt.bits == 4:
            v = uq.reshape(panels, nb, PANEL, 2, 4, 4)  # [.., half, chunk, t]
            byte = v[:, :, :, 0] | (v[:, :, :, 1] << 4)  # [P, nb, 16, 4, 4]
            vals = byte.permute(0, 1, 3, 2, 4).reshape(panels, nb, 256)
        else:
            v = uq.reshape(panels, nb, PANEL, 8, 4)
            vals = v.permute(0, 1, 3, 2, 4).reshape(panels, nb, 512)

        def scales(s: torch.Tensor) -> torch.Tensor:
            s = s.to(torch.float16).view(panels, PANEL, nb).permute(0, 2, 1).contiguous()
            return s.view(torch.uint8).view(panels, nb, 32)

        parts = [vals, scales(d)] + ([] if m is None else [scales(m)])
        data = torch.cat(parts, -1).reshape(-1).contiguous()
        return cls(data, fmt, n, k, source)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The inverse of :meth:`pack`: u [n, k] uint8, d [n, k/32] fp16, m or None."""
        f, nb = self.fmt, self.k // BLOCK
        panels = -(-self.n // PANEL)
        blocks = self.data.view(panels, nb, f.block_bytes)
        vb = f.bits * 64
        if f.bits == 4:
            byte = blocks[:, :, :vb].reshape(panels, nb, 4, PANEL, 4).permute(0, 1, 3, 2, 4)
            u = torch.stack([byte & 15, byte >> 4], 3)  # [P, nb, 16, half, chunk, t]
        else:
            u = blocks[:, :, :vb].reshape(panels, nb, 8, PANEL, 4).permute(0, 1, 3, 2, 4)
        u = u.reshape(panels, nb, PANEL, BLOCK).permute(0, 2, 1, 3).reshape(-1, self.k)

        def scales(off: int) -> torch.Tensor:
            s = blocks[:, :, off : off + 32].contiguous().view(torch.float16)  # [P, nb, 16]
            return s.permute(0, 2, 1).reshape(-1, nb)

        d = scales(vb)
        m = scales(vb + 32) if f.has_min else None
        n = self.n
        return u[:n].contiguous(), d[:n].contiguous(), None if m is None else m[:n].contiguous()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [n, k] as floats (fp32 arithmetic: ``d * u + m`` or ``d * (u - zero)``)."""
        u, d, m = self.unpack()
        uf = u.float().view(self.n, -1, BLOCK)
        df = d.float().unsqueeze(-1)
        if self.fmt.has_min:
            assert m is not None
            w = df * uf + m.float().unsqueeze(-1)
        else:
            w = df * (uf - self.fmt.zero)
        return natural_columns(w.reshape(self.n, self.k), self.in_perm).to(dtype)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Row-concatenate weights of one format and k (a fused qkv or gate_up)."""
        cat_k = getattr(type(parts[0]), "cat_k", None)  # K-quants (quant/kquant.py)
        if cat_k is not None:
            return cat_k(parts)  # type: ignore[no-any-return]
        fmt, k = parts[0].fmt, parts[0].k
        if any(p.fmt != fmt or p.k != k for p in parts):
            raise ValueError("QuantWeight.cat needs parts of one format and input size")
        perm = same_in_perm(parts)
        if all(p.n % PANEL == 0 for p in parts):  # panels line up: concatenate bytes
            data = cat_bytes([p.data for p in parts])
            return QuantWeight(data, fmt, sum(p.n for p in parts), k, parts[0].source, perm)
        us, ds, ms = zip(*(p.unpack() for p in parts), strict=True)
        m = None if not fmt.has_min else torch.cat(ms)  # type: ignore[arg-type]
        out = QuantWeight.pack(torch.cat(us), torch.cat(ds), m, fmt, parts[0].source)
        out.in_perm = perm
        return out

    def select_rows(self, index: torch.Tensor) -> QuantWeight:
        """Rows ``index`` of W (a permutation, e.g. llama.cpp's q/k row order undone)."""
        u, d, m = self.unpack()
        out = QuantWeight.pack(
            u[index], d[index], None if m is None else m[index], self.fmt, self.source
        )
        out.in_perm = self.in_perm
        return out


def cat_bytes(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` of flat tensors; a view, not a copy, when the parts already
    lie end to end in one storage (the packed weight cache maps fused parts so)."""
    first = parts[0]
    storage = first.untyped_storage()
    end = first.data_ptr() + first.numel() * first.element_size()
    adjacent = all(p.is_contiguous() and p.dim() == 1 for p in parts)
    for p in parts[1:]:
        if (
            not adjacent
            or p.untyped_storage().data_ptr() != storage.data_ptr()
            or p.data_ptr() != end
        ):
            adjacent = False
            break
        end += p.numel() * p.element_size()
    if not adjacent or len(parts) == 1:
        return torch.cat(parts)
    total = sum(p.numel() for p in parts)
    return first.new_empty(0).set_(storage, first.storage_offset(), (total,), (1,))


def same_in_perm(parts: list[QuantWeight]) -> torch.Tensor | None:
    """The input permutation fused parts share; ValueError when they differ (fused
    act-order layers need one input column order)."""
    perm = parts[0].in_perm
    for p in parts[1:]:
        if (p.in_perm is None) != (perm is None) or (
            perm is not None and p.in_perm is not None and not torch.equal(p.in_perm, perm)
        ):
            raise ValueError(
                "fused quantized layers (q/k/v or gate/up) have different act-order input "
                "permutations (g_idx); kvserve needs one order per fused layer"
            )
    return perm


def natural_columns(w: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """Stored-order columns (column j = input ``perm[j]``) back in input order."""
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


# --------------------------------------------------------------------------- quantizers


def quantize_symmetric8(w: torch.Tensor) -> QuantWeight:
    """Float W [n, k] -> q8_0: per block d = amax / 127 (fp16), q = round(w / d)."""
    n, k = w.shape
    blocks = w.float().view(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1) / 127.0).to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros(()))
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127)
    return QuantWeight.pack((q + 128).to(torch.uint8).view(n, k), d, None, Q8_0, "int8")


def quantize_4bit(w: torch.Tensor, zero_point: bool = True) -> QuantWeight:
    """Float W [n, k] -> 4-bit blocks of 32: with zero point (q4_1: m = block min,
    d = (max - min) / 15) or symmetric (q4_0: d = amax / 7, u = round(w / d) + 8)."""
    n, k = w.shape
    blocks = w.float().view(n, k // BLOCK, BLOCK)
    if zero_point:
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        d = ((hi - lo) / 15.0).to(torch.float16)
        m = lo.to(torch.float16)
        inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros(()))
        u = torch.round((blocks - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15)
        return QuantWeight.pack(u.to(torch.uint8).view(n, k), d, m, Q4_1, "int4")
    d = (blocks.abs().amax(-1) / 7.0).to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros(()))
    u = (torch.round(blocks * inv.unsqueeze(-1)) + 8).clamp(0, 15)
    return QuantWeight.pack(u.to(torch.uint8).view(n, k), d, None, Q4_0, "int4-sym")


# --------------------------------------------------------------------------- reference


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, k] -> (q [M, k/32, 32] int8 values as int32, d_x [M, k/32] fp32, sum(q)
    [M, k/32] int32), the same rule as the kernel: d = amax / 127, q = round(x / d)
    (to nearest even, via the reciprocal)."""
    m_rows, k = x.shape
    blocks = x.float().view(m_rows, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros(()))
    q = torch.round(blocks * inv.unsqueeze(-1)).to(torch.int32)
    return q, d, q.sum(-1)


def reference_linear(
    x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (fp64 sums, so it differs from the kernel only
    by fp32 rounding): ``sum_b float(isum_b - zero * sum q) * d * d_x (+ m * d_x * sum q)``.
    Returns fp32 [M, n]."""
    k_reference = getattr(w, "reference_linear_k", None)  # K-quants (quant/kquant.py)
    if k_reference is not None:
        return k_reference(x, bias)
    if w.in_perm is not None:
        x = x[:, w.in_perm]
    q, dx, sq = quantize_activations(x)
    u, d, m = w.unpack()
    nb = w.k // BLOCK
    uw = u.view(w.n, nb, BLOCK).to(torch.float64)
    isum = torch.einsum("mbj,nbj->mnb", q.to(torch.float64), uw)  # exact integers
    scale = d.double().unsqueeze(0) * dx.double().unsqueeze(1)  # [M, n, nb]
    if w.fmt.has_min:
        assert m is not None
        terms = isum * scale + m.double().unsqueeze(0) * (dx.double() * sq.double()).unsqueeze(1)
    else:
        terms = (isum - w.fmt.zero * sq.double().unsqueeze(1)) * scale
    out = terms.sum(-1)
    if bias is not None:
        out = out + bias.double()
    return out.float()
