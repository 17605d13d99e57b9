"""``--compile``: decode steps as ``torch.compile`` graphs, one per decode bucket.

What is compiled: the model forward of *decode-only* steps (every scheduled request
has one row; dummy rows pad the batch to its bucket). With the separated policy
those steps have static shapes, one per ``num_seqs_buckets`` entry, each compiled and
warmed at startup with dummy rows only (they write no KV and read the null block);
with the mixed policy the step is compiled once with dynamic shapes. Steps that
carry prefill rows run eager: a prefill's cached length is a Python-level choice of
segments, so it would specialise a graph per length.

Inside the graph the layers are the portable PyTorch ops (inductor fuses the
elementwise parts: norms, RoPE, SiLU), each linear is one opaque operator over the
eager kernels (``kvserve::fast_linear``: prepacked oneDNN, or the native float32
panels), and the KV write plus paged attention is one operator that mutates the cache
in place (``kvserve::write_kv_and_attend``; a write and a separate read made inductor
copy each layer's whole cache twice per step).

Measured (``benchmarks/compile_bench.py``, bfloat16, 32 x 256 -> 64 at 16 running):
compiled decode steps take 38-43 ms against eager's 28-35 ms, since the eager forward
is already a chain of fused native kernels and the operators add dispatch; startup is
53 s (separated, cold inductor cache) or 14 s (warm), 122 s / 56 s with the mixed
policy's dynamic graph. ``--compile`` is therefore off by default.
Inductor's on-disk cache lives in ``~/.cache/kvserve/inductor`` (or
``TORCHINDUCTOR_CACHE_DIR``), so the next start reuses the compiled code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvserve.model.attention import AttentionMetadata, ResolvedBackend, build_attention_metadata
from kvserve.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled code (set before the first compile)."""
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvserve"
    )
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))


class CompiledDecode:
    """The decode-step forward compiled per bucket; see the module docstring.

    Rules for callers: call :meth:`supports` first and run the eager model for steps
    it refuses; ``max_model_len`` bounds every position the graphs will see.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        buckets: Sequence[int] | None,
        max_model_len: int,
        block_size: int,
        attention_backend: ResolvedBackend,
    ) -> None:
        if attention_backend != "native":
            raise ValueError(
                "--compile needs the native attention kernel (a C++ compiler and a "
                "float32/bfloat16 model on the CPU): drop --compile or fix the build"
            )
        inductor_cache_dir()
        self.model = model
        self.buckets = tuple(buckets) if buckets else None
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        model.prepare_rope(max_model_len)  # no data-dependent table growth in a graph
        torch._dynamo.config.cache_size_limit = max(64, 2 * len(self.buckets or ()))
        # one static graph per bucket (separated policy) or one dynamic graph (mixed)
        self._fn: Any = torch.compile(model.forward, dynamic=self.buckets is None)
        self.warmup_s = 0.0
        self.num_calls = 0  # compiled steps run (warm-up included)

    @staticmethod
    def supports(meta: AttentionMetadata) -> bool:
        """Decode-only native steps (no prefill rows) run compiled."""
        return meta.native is not None and not meta.native.prefills

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The compiled forward; shapes depend on the number of rows only.

        Block tables are padded to ``max_model_len / block_size`` columns, and every
        row writes its K/V: padding rows into slot 0 of the null block, which no real
        row ever reads (dummy rows, which read it, have meaningless outputs).
        """
        nb = meta.native
        assert nb is not None and not nb.prefills, "call supports() first"
        tables = torch.zeros(nb.block_tables.shape[0], self.max_blocks, dtype=torch.int64)
        tables[:, : nb.block_tables.shape[1]] = nb.block_tables
        static = dataclasses.replace(
            meta,
            write_rows=None,
            write_slots=meta.slot_mapping.clamp(min=0),
            native=dataclasses.replace(nb, block_tables=tables),
        )
        self.num_calls += 1
        return self._fn(input_ids, positions, kv_caches, static)

    def warm_up(
        self,
        kv_caches: list[torch.Tensor],
        kv_segment_size: int,
        model_dtype: torch.dtype | None = None,
        kv_8bit: bool = False,
    ) -> float:
        """Compile every bucket now, on dummy rows only; returns the seconds it took.
        An 8-bit cache (``kv_8bit``) needs ``model_dtype`` (its codes are not it)."""
        t0 = time.perf_counter()
        sizes = self.buckets or (1, 2, 3)
        with torch.inference_mode():
            for num_rows in sizes:
                meta = build_attention_metadata(
                    [],
                    num_tokens=num_rows,
                    num_dummy_decode_rows=num_rows,
                    block_size=self.block_size,
                    kv_segment_size=kv_segment_size,
                    backend="native",
                    kv_dtype=model_dtype if kv_8bit and model_dtype else kv_caches[0].dtype,
                    kernels=self.model.kernels,
                    kv_8bit=kv_8bit,
                )
                ids = torch.zeros(num_rows, dtype=torch.long)
                positions = torch.zeros(num_rows, dtype=torch.long)
                self(ids, positions, kv_caches, meta)
        self.warmup_s = time.perf_counter() - t0
        logger.info("compiled %d decode shape(s) in %.1f s", len(sizes), self.warmup_s)
        return self.warmup_s
