"""Binding of ``csrc/paged_attention.cpp``: attention of any rows over the paged KV cache.

:class:`PagedAttention` is the ``attention`` family of
:class:`~kvserve.model.kernels.backend.KernelBackend` (decode rows, and prefill rows
where no prefill kernel takes them).
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.model.kernels._ctypes import (
    DTYPE_CODES,
    F32,
    I32,
    I64,
    PAGED_PARAMS,
    PTR,
    TAIL_PARAMS,
    CFunction,
    attention_out,
    paged_args,
    tail_args,
)

_PARAMS = [
    *PAGED_PARAMS,
    ("seg", I32),
    ("scale", F32),
    ("dtype", I32),
    ("row_tile", I32),
    *TAIL_PARAMS,
]


_U64 = ctypes.c_uint64
_READ_SLICES = [("buf", PTR), ("bytes", I64), ("num_threads", I32)]
_READ_PAGES = [
    ("kv", PTR),
    ("num_blocks", I64),
    ("block_size", I32),
    ("num_kv_heads", I32),
    ("head_dim", I32),
    ("elem_size", I32),
    ("seqs", PTR),
    ("num_seqs", I64),
    ("block_tables", PTR),
    ("max_blocks", I64),
    ("num_threads", I32),
]


class PagedAttention:
    """``kvs_paged_attention``; call the object (see :meth:`__call__`). Also the
    reads the decode kernel's speed is measured against (:meth:`read_slices`,
    :meth:`read_pages`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = CFunction(lib, "kvs_paged_attention", _PARAMS)
        self._read_slices = CFunction(lib, "kvs_read_slices", _READ_SLICES, restype=_U64)
        self._read_pages = CFunction(lib, "kvs_read_pages", _READ_PAGES, restype=_U64)

    def read_slices(self, buf: torch.Tensor, num_threads: int) -> int:
        """Read every byte of the contiguous CPU tensor ``buf`` with 512-bit loads,
        one contiguous slice per thread: the machine's stream-read speed on
        ``num_threads`` threads. Returns the OR of its 64-bit words."""
        if not buf.is_contiguous():
            raise ValueError("read_slices needs a contiguous tensor")
        return int(
            self._read_slices(
                buf=buf.data_ptr(), bytes=buf.numel() * buf.element_size(), num_threads=num_threads
            )
        )

    def read_pages(
        self,
        kv_cache: torch.Tensor,
        seqs: torch.Tensor,
        block_tables: torch.Tensor,
        num_threads: int,
    ) -> int:
        """Read the K and V bytes a kernel call with these arguments reads (same rules
        as :meth:`__call__`), in its task order and schedule, with no arithmetic: the
        access pattern's own limit. Returns an OR of the bytes read."""
        _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        return int(
            self._read_pages(
                kv=kv_cache.data_ptr(),
                num_blocks=num_blocks,
                block_size=block_size,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                elem_size=kv_cache.element_size(),
                seqs=seqs.data_ptr(),
                num_seqs=seqs.shape[0],
                block_tables=block_tables.data_ptr(),
                max_blocks=block_tables.shape[1],
                num_threads=num_threads,
            )
        )

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        """Whether the kernel takes q/KV of this dtype (float32, bfloat16)."""
        return dtype in DTYPE_CODES

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
        tensor is returned. The kernel does not check bounds. A row's result depends
        on its own keys and the segment size only (not on the other rows or threads).
        """
        out, merge = attention_out(q, out, lse)
        rc = self._fn(
            **paged_args(q, out, kv_cache, seqs, block_tables),
            seg=kv_segment_size,
            scale=scale,
            dtype=DTYPE_CODES[q.dtype],
            row_tile=row_tile,
            **tail_args(lse, row_map, merge),
        )
        if rc != 0:
            raise RuntimeError(f"kvs_paged_attention returned {rc} for dtype {q.dtype}")
        return out
