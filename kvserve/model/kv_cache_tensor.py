"""The paged KV cache tensor: its layout, its size per block, its allocation.

Below the model runner and the draft-model proposer (``kvserve.spec_decode``), which
both allocate one, so neither imports the other for it. Layout::

    kv_cache: [num_layers, 2, num_kv_heads, num_kv_blocks, block_size, head_dim]
              layer i's view kv_cache[i] is [2 (K, V), Hk, blocks, block_size, D]
              (head-major; see kvserve.model.attention)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.model.hugepages import zeros_hugepages
from kvserve.model.kernels.kv8 import KVCacheFormat, resolve_kv_cache_dtype
from kvserve.model.lazy_memory import lazy_zeros

if TYPE_CHECKING:
    from kvserve.model.llama import LlamaForCausalLM
    from kvserve.model.loader import LoadedModel


def kv_cache_bytes_per_block(
    loaded: LoadedModel, block_size: int, kv_format: KVCacheFormat | None = None
) -> int:
    """Bytes one KV block takes over all layers (K and V; 8-bit formats: codes and
    their per-row scales). ``kv_format`` None: the model dtype."""
    cfg = loaded.model.config
    fmt = kv_format or resolve_kv_cache_dtype("auto", loaded.dtype)
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * fmt.row_bytes(cfg.head_dim)


def allocate_kv_cache(
    model: LlamaForCausalLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kv_format: KVCacheFormat | None = None,
    *,
    lazy: bool = False,
) -> torch.Tensor:
    """Zeroed cache ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]``
    (8-bit ``kv_format``: last dim ``head_dim + 4``, see :mod:`kvserve.model.kernels.kv8`).

    ``cache[i]`` is layer ``i``'s view in the layout of ``kvserve.model.attention``.
    ``lazy`` (CPU): memory committed as blocks are first written
    (:func:`kvserve.model.lazy_memory.lazy_zeros`), no huge pages.
    """
    cfg = model.config
    last = cfg.head_dim
    if kv_format is not None:
        dtype, last = kv_format.torch_dtype, kv_format.last_dim(cfg.head_dim)
    shape = (cfg.num_layers, 2, cfg.num_kv_heads, num_blocks, block_size, last)
    if lazy and torch.device(device).type == "cpu":
        return lazy_zeros(*shape, dtype=dtype)
    if torch.device(device).type == "cpu":  # scattered block reads: fewer TLB misses
        return zeros_hugepages(*shape, dtype=dtype)
    return torch.zeros(*shape, dtype=dtype, device=device)
