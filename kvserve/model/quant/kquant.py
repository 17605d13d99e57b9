"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept as they are: the panel layout of
``csrc/linear_kquant.cpp`` (formats ``kq4`` / ``kq5`` / ``kq6``), the conversion from
GGUF super-blocks, and the PyTorch reference of the kernel.

A K-quant weight W [n, k] (k a multiple of 256) is, per column and super-block of 256
values, an fp16 scale D (and fp16 dmin M), and per sub-block an integer scale ``sc``
(and minimum ``mn``)::

    kq4 / kq5 (Q4_K / Q5_K, sub-blocks of 32, 6-bit sc and mn):  w = (D * sc) * u - M * mn
    kq6 (Q6_K, sub-blocks of 16, int8 sc):                       w = (D * sc) * (u - 32)

with u of 4, 5 or 6 bits. The file's integers and scales are stored unchanged, so the
executed weight equals gguf's dequantization bit for bit (``D * sc``, ``M * mn`` and
their products with u are exact in fp32). Bytes per weight: kq4 0.578 (file 0.5625),
kq5 0.703 (file 0.6875), kq6 0.820 (file 0.820, the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.model.quant.formats import (
    BLOCK,
    PANEL,
    QuantFormat,
    QuantWeight,
    cat_bytes,
    quantize_activations,
)

if TYPE_CHECKING:
    from kvserve.model.quant.kernel import QuantKernel

SUPER = 256  # values per super-block


@dataclass(frozen=True)
class KQuantFormat(QuantFormat):
    """A K-quant panel format: ``planes`` high bit planes beyond the nibble, sub-blocks
    of ``sub`` values. ``zero`` / ``has_min`` as in :class:`QuantFormat`."""

    planes: int = 0
    sub: int = 32

    @property
    def block_bytes(self) -> int:
        """Bytes of one 16-column x 32-k block's values (scales live per tile)."""
        return 256 + 64 * self.planes

    @property
    def tile_bytes(self) -> int:
        """Bytes of one 16-column x 256-k tile: values, sub-block scales, D (and M)."""
        return 8 * self.block_bytes + 256 + (64 if self.has_min else 32)


KQ4 = KQuantFormat("kq4", 16, 4, 0, True, planes=0, sub=32)
KQ5 = KQuantFormat("kq5", 17, 5, 0, True, planes=1, sub=32)
KQ6 = KQuantFormat("kq6", 18, 6, 32, False, planes=2, sub=16)
KFORMATS: dict[str, KQuantFormat] = {f.name: f for f in (KQ4, KQ5, KQ6)}
GGUF_TYPES = {"Q4_K": KQ4, "Q5_K": KQ5, "Q6_K": KQ6}
GGUF_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


@dataclass
class KQuantWeight(QuantWeight):
    """A K-quant weight [n, k] in the layout of ``csrc/linear_kquant.cpp`` (``data``:
    flat uint8). Rules: ``k % 256 == 0``; ``data`` has ``ceil(n/16) * (k/256) *
    fmt.tile_bytes`` bytes; ``fmt`` is one of :data:`KFORMATS`."""

    def reference_linear_k(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`reference_linear_k` of this weight (what ``formats.reference_linear``
        dispatches to for a K-quant weight)."""
        return reference_linear_k(x, self, bias)

    @classmethod
    def pack_k(
        cls,
        u: torch.Tensor,
        sc: torch.Tensor,
        mn: torch.Tensor | None,
        d: torch.Tensor,
        dmin: torch.Tensor | None,
        fmt: KQuantFormat,
        source: str = "",
    ) -> KQuantWeight:
        """u [n, k] uint8 (< 2**bits); sc [n, k/sub] (uint8 for kq4/kq5, int8 for kq6);
        mn [n, k/32] uint8 or None; d, dmin [n, k/256] fp16 -> the panel layout.
        Padding columns get zero scales (they compute 0)."""
        n, k = u.shape
        if k % SUPER:
            raise ValueError(f"{fmt.name} weights need k divisible by {SUPER}, got {k}")
        if (mn is None) == fmt.has_min or (dmin is None) == fmt.has_min:
            raise ValueError(f"format {fmt.name} {'needs' if fmt.has_min else 'has no'} minimum")
        nsb, panels = k // SUPER, -(-n // PANEL)
        pad = panels * PANEL - n

        def padded(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t

        u = padded(u.to(torch.uint8))
        uq = u.view(panels, PANEL, nsb, 8, BLOCK).permute(0, 2, 3, 1, 4)  # [P, S, 8, 16, 32]
        nib = (uq & 15).reshape(panels, nsb, 8, PANEL, 2, 4, 4)  # [.., col, half, chunk, t]
        byte = nib[..., 0, :, :] | (nib[..., 1, :, :] << 4)  # [P, S, 8, col, chunk, t]
        parts = [byte.permute(0, 1, 2, 4, 3, 5).reshape(panels, nsb, 8, 256)]
        weights = (1 << torch.arange(8, dtype=torch.int32)).view(1, 1, 1, 1, 8, 1)
        for p in range(fmt.planes):
            bit = ((uq >> (4 + p)) & 1).to(torch.int32).reshape(panels, nsb, 8, PANEL, 8, 4)
            plane = (bit * weights).sum(4).to(torch.uint8)  # [P, S, 8, col, t]
            parts.append(plane.reshape(panels, nsb, 8, 64))
        vals = torch.cat(parts, -1).reshape(panels, nsb, 8 * fmt.block_bytes)

        def per_col(t: torch.Tensor, groups: int) -> torch.Tensor:
            """[n, S * groups] one byte each -> [P, S, groups * 16] (group-major)."""
            t = padded(t.contiguous().view(torch.uint8))
            return t.view(panels, PANEL, nsb, groups).permute(0, 2, 3, 1).reshape(panels, nsb, -1)

        def halves(t: torch.Tensor) -> torch.Tensor:
            t = padded(t.to(torch.float16).contiguous()).view(panels, PANEL, nsb)
            return t.permute(0, 2, 1).contiguous().view(torch.uint8).view(panels, nsb, 32)

        if fmt.has_min:
            assert mn is not None and dmin is not None
            tail = [per_col(sc.to(torch.uint8), 8), per_col(mn.to(torch.uint8), 8)]
            tail += [halves(d), halves(dmin)]
        else:
            tail = [per_col(sc.to(torch.int8), 16), halves(d)]
        data = torch.cat([vals, *tail], -1).reshape(-1).contiguous()
        return cls(data, fmt, n, k, source)

    def unpack_k(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The inverse of :meth:`pack_k`: (u, sc, mn, d, dmin) as given to it."""
        f = self.fmt
        assert isinstance(f, KQuantFormat)
        nsb, panels, n = self.k // SUPER, -(-self.n // PANEL), self.n
        tiles = self.data.view(panels, nsb, f.tile_bytes)
        vals = tiles[..., : 8 * f.block_bytes].reshape(panels, nsb, 8, f.block_bytes)
        byte = vals[..., :256].reshape(panels, nsb, 8, 4, PANEL, 4).permute(0, 1, 2, 4, 3, 5)
        u = torch.stack([byte & 15, byte >> 4], 4)  # [P, S, 8, col, half, chunk, t]
        u = u.reshape(panels, nsb, 8, PANEL, BLOCK)
        for p in range(f.planes):
            plane = vals[..., 256 + 64 * p : 320 + 64 * p].reshape(panels, nsb, 8, PANEL, 1, 4)
            shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 1, 1, 8, 1)
            bit = ((plane >> shifts) & 1).reshape(panels, nsb, 8, PANEL, BLOCK)
            u = u | (bit << (4 + p))
        u = u.permute(0, 3, 1, 2, 4).reshape(-1, self.k)[:n].contiguous()
        off = 8 * f.block_bytes

        def per_col(start: int, groups: int) -> torch.Tensor:
            t = tiles[..., start : start + groups * 16].reshape(panels, nsb, groups, PANEL)
            return t.permute(0, 3, 1, 2).reshape(-1, nsb * groups)[:n].contiguous()

        def halves(start: int) -> torch.Tensor:
            t = tiles[..., start : start + 32].contiguous().view(torch.float16)  # [P, S, 16]
            return t.permute(0, 2, 1).reshape(-1, nsb)[:n].contiguous()

        if f.has_min:
            sc, mn = per_col(off, 8), per_col(off + 128, 8)
            return u, sc, mn, halves(off + 256), halves(off + 288)
        return u, per_col(off, 16).view(torch.int8), None, halves(off + 256), None

    # QuantWeight's interface ---------------------------------------------------

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        raise TypeError("K-quant weights have no per-32 (u, d, m) form; use unpack_k")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [n, k] exactly as the kernel and gguf's dequantization give it (fp32)."""
        u, sc, mn, d, dmin = self.unpack_k()
        f = self.fmt
        assert isinstance(f, KQuantFormat)
        sub = f.sub
        per_sb = SUPER // sub
        ds = d.float().repeat_interleave(per_sb, 1) * sc.float()  # [n, k/sub], exact
        uf = u.float().view(self.n, -1, sub)
        if f.has_min:
            assert mn is not None and dmin is not None
            mm = dmin.float().repeat_interleave(8, 1) * mn.float()
            w = ds.unsqueeze(-1) * uf - mm.unsqueeze(-1)
        else:
            w = ds.unsqueeze(-1) * (uf - float(f.zero))
        return w.reshape(self.n, self.k).to(dtype)

    def select_rows(self, index: torch.Tensor) -> KQuantWeight:
        u, sc, mn, d, dmin = self.unpack_k()
        f = self.fmt
        assert isinstance(f, KQuantFormat)
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return KQuantWeight.pack_k(
            u[index], sc[index], pick(mn), d[index], pick(dmin), f, self.source
        )

    @staticmethod
    def cat_k(parts: list[KQuantWeight]) -> KQuantWeight:
        """Row-concatenate K-quant weights of one format and k."""
        f, k = parts[0].fmt, parts[0].k
        assert isinstance(f, KQuantFormat)
        if any(p.fmt != f or p.k != k for p in parts):
            raise ValueError("KQuantWeight.cat needs parts of one format and input size")
        if all(p.n % PANEL == 0 for p in parts):
            data = cat_bytes([p.data for p in parts])
            return KQuantWeight(data, f, sum(p.n for p in parts), k, parts[0].source)
        us, scs, mns, ds, dms = zip(*(p.unpack_k() for p in parts), strict=True)
        mn = torch.cat(mns) if f.has_min else None  # type: ignore[arg-type]
        dm = torch.cat(dms) if f.has_min else None  # type: ignore[arg-type]
        return KQuantWeight.pack_k(
            torch.cat(us), torch.cat(scs), mn, torch.cat(ds), dm, f, parts[0].source
        )


# --------------------------------------------------------------------------- GGUF


def _scale_min_6bit(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 packed bytes [N, 12] -> 6-bit (sc, mn) [N, 8] each (llama.cpp's
    get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, 4-7 split
    across the nibbles of bytes 8-11 and the top 2 bits of bytes 0-7)."""
    s = s.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def from_gguf(
    raw: np.ndarray, type_name: str, n: int, k: int, kernel: QuantKernel | None = None
) -> KQuantWeight:
    """Raw GGUF rows of Q4_K / Q5_K / Q6_K ([n, row_bytes] uint8, or flat) -> a
    :class:`KQuantWeight` holding the same integers and scales (no requantization).
    ``kernel``: the quantized-weight kernels (the backend's ``quant_linear``) repack in C (3-7x the NumPy path's
    speed, 36-70 MB/s of file on one thread; the same bytes, tested), else in NumPy. Raises ValueError for another
    type or a k that is not a multiple of 256."""
    if type_name not in GGUF_TYPES:
        raise ValueError(f"not a K-quant handled here: {type_name}")
    if k % SUPER:
        raise ValueError(f"{type_name} rows need a multiple of {SUPER} values, got {k}")
    nsb = n * (k // SUPER)
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(nsb, GGUF_BLOCK_BYTES[type_name])
    fmt = GGUF_TYPES[type_name]
    if kernel is not None:
        size = -(-n // PANEL) * (k // SUPER) * fmt.tile_bytes
        data = kernel.pack_gguf_kquant(b, fmt.code, n, k, size)
        return KQuantWeight(data, fmt, n, k, f"gguf:{type_name}")

    def t(a: np.ndarray, cols: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).reshape(n, cols)

    if type_name == "Q6_K":  # ql[128] qh[64] scales[16] int8, d fp16
        ql = b[:, :128].reshape(nsb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & np.uint8(15)).reshape(nsb, 2, 4, 32)  # [.., half of 128, quarter, 32]
        qh = b[:, 128:192].reshape(nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1
        )
        qh = (qh & np.uint8(3)).reshape(nsb, 2, 4, 32)
        u = (ql | (qh << np.uint8(4))).reshape(nsb, SUPER)
        sc = b[:, 192:208].view(np.int8)
        d = b[:, 208:210].copy().view(np.float16)
        return KQuantWeight.pack_k(
            t(u, k), t(sc, k // 16), None, t(d, k // SUPER), None, fmt, f"gguf:{type_name}"
        )
    d = b[:, 0:2].copy().view(np.float16)
    dmin = b[:, 2:4].copy().view(np.float16)
    sc, mn = _scale_min_6bit(b[:, 4:16])
    if type_name == "Q4_K":  # qs[128]: 4 groups of 64 values, low nibbles first
        qs = b[:, 16:144].reshape(nsb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        u = (qs & np.uint8(15)).reshape(nsb, SUPER)
    else:  # Q5_K: qh[32] (bit i of byte l: sub-block i's value l), then qs[128]
        qs = b[:, 48:176].reshape(nsb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        hi = b[:, 16:48].reshape(nsb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        u = (qs & np.uint8(15)).reshape(nsb, 8, 32) | ((hi & np.uint8(1)) << np.uint8(4))
        u = u.reshape(nsb, SUPER)
    return KQuantWeight.pack_k(
        t(u, k),
        t(sc, k // 32),
        t(mn, k // 32),
        t(d, k // SUPER),
        t(dmin, k // SUPER),
        fmt,
        f"gguf:{type_name}",
    )


# --------------------------------------------------------------------------- reference


def reference_linear_k(
    x: torch.Tensor, w: KQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch, fp64 sums: ``sum_b d_x,b * sum_j w_j q_j``
    over the per-32 int8 activations (the weights exact), so it differs from the kernel
    only by the kernel's fp32 rounding. Returns fp32 [M, n]."""
    q, dx, _ = quantize_activations(x)
    wd = w.dequantize().double().view(w.n, -1, BLOCK)
    out = torch.einsum("mbj,nbj,mb->mn", q.double(), wd, dx.double())
    if bias is not None:
        out = out + bias.double()
    return out.float()
