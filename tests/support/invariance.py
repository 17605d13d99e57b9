"""Batch-invariance harness: run token sequences through the model in any schedule.

The logits a model gives at position ``p`` of a sequence are a function of the
sequence's tokens ``[0, p]`` alone. :class:`Harness` runs sequences through
``LlamaForCausalLM.forward`` + ``compute_logits`` on a paged KV cache it manages, in
any schedule of steps: each step is a list of ``(sequence, number of tokens)``
chunks (a one-token chunk is a decode row), many sequences per step, prefill chunks
before one-row chunks as the metadata builder requires. A sequence may start from
another sequence's blocks (a prefix-cache hit: the KV was written by the other
sequence's own computation). The logits of every row it computes are recorded per
position, so any schedule can be compared bitwise against the sequence run alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.model.llama import LlamaForCausalLM
from kvserve.worker.model_runner import allocate_kv_cache


@dataclass
class Seq:
    """One sequence: its tokens, its blocks, how far its KV is computed."""

    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [V] fp32


class Harness:
    """Drives a model over a KV cache of ``num_blocks`` blocks (block 0 is null).

    Rules: every sequence's chunks run in order; a step holds each sequence at most
    once; blocks are never freed (make a new harness per test case).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        dtype: torch.dtype,
        *,
        num_blocks: int = 512,
        block_size: int = 16,
        kv_segment_size: int = 64,
        batch_invariant: bool | None = None,
        invariant_max_context: int = 0,
    ) -> None:
        self.model = model
        self.invariant_max_context = invariant_max_context
        self.dtype = dtype
        self.block_size = block_size
        self.kv_segment_size = kv_segment_size
        self.batch_invariant = batch_invariant
        if batch_invariant is not None or invariant_max_context:
            # the automatic mode (invariant_max_context) runs the invariant linears too
            model.set_batch_invariant(bool(batch_invariant) or invariant_max_context > 0)
        self.kv = allocate_kv_cache(model, num_blocks, block_size, dtype)
        self.kv_caches = list(self.kv.unbind(0))
        self.next_block = 1
        self.num_blocks = num_blocks

    def new_seq(self, tokens: list[int], prefix_from: Seq | None = None, shared: int = 0) -> Seq:
        """A sequence; with ``prefix_from``, its first ``shared`` tokens (whole blocks,
        computed by ``prefix_from`` with the same tokens) come from that sequence's
        blocks, as a prefix-cache hit gives them."""
        s = Seq(list(tokens))
        if prefix_from is not None and shared:
            assert shared % self.block_size == 0 and shared <= prefix_from.computed
            assert prefix_from.tokens[:shared] == s.tokens[:shared]
            s.blocks = prefix_from.blocks[: shared // self.block_size]
            s.computed = shared
        return s

    def _grow(self, s: Seq, upto: int) -> None:
        need = -(-upto // self.block_size)
        while len(s.blocks) < need:
            if self.next_block >= self.num_blocks:
                raise RuntimeError("harness ran out of KV blocks")
            s.blocks.append(self.next_block)
            self.next_block += 1

    @torch.inference_mode()
    def step(self, chunks: list[tuple[Seq, int]], num_dummy: int = 0) -> None:
        """Run one step; records the logits of every computed row of every chunk."""
        chunks = sorted(chunks, key=lambda c: c[1] == 1)  # prefill chunks first (stable)
        specs, ids, pos = [], [], []
        for s, n in chunks:
            assert 1 <= n <= len(s.tokens) - s.computed
            self._grow(s, s.computed + n)
            specs.append(SeqSpec(len(ids), n, n, s.computed, s.blocks))
            ids.extend(s.tokens[s.computed : s.computed + n])
            pos.extend(range(s.computed, s.computed + n))
        ids.extend([0] * num_dummy)
        pos.extend([0] * num_dummy)
        extra: dict[str, bool | int] = {"invariant_max_context": self.invariant_max_context}
        if self.batch_invariant is not None:
            extra["batch_invariant"] = self.batch_invariant
        meta = build_attention_metadata(
            specs,
            num_tokens=len(ids),
            num_dummy_decode_rows=num_dummy,
            block_size=self.block_size,
            kv_segment_size=self.kv_segment_size,
            kv_dtype=self.dtype,
            **extra,
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long), torch.tensor(pos), self.kv_caches, meta
        )
        logits = self.model.compute_logits(hidden)
        row = 0
        for s, n in chunks:
            for j in range(n):
                s.logits[s.computed + j] = logits[row + j].clone()
            row += n
            s.computed += n

    def run_alone(self, tokens: list[int]) -> Seq:
        """The reference: the whole sequence as one prefill chunk, nothing else."""
        s = self.new_seq(tokens)
        self.step([(s, len(tokens))])
        return s


def first_mismatch(got: Seq, ref: Seq) -> int | None:
    """The first position whose logits differ bitwise between ``got`` and ``ref``."""
    for p in sorted(got.logits):
        if not torch.equal(got.logits[p], ref.logits[p]):
            return p
    return None
