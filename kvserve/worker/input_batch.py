"""Persistent per-request state of the model runner and the per-step input tensors.

The scheduler sends diffs (:mod:`kvserve.sched.output`): a request's first step
carries its prompt, outputs so far and all its block ids; later steps only the blocks
added since. :class:`InputBatch` keeps each request's token history (for penalties
and the sampler's seeded draws) and block ids, and drops them for
``finished_req_ids``.

Each step :meth:`InputBatch.prepare_inputs` lays the scheduled requests out as one
flat batch, prefill chunks first, then one-row requests (decodes), then dummy decode
rows::

    rows      [ A0 A1 A2 pad pad | B0 B1 | C0 | D0 | dummy dummy ]
    positions [ 7  8  9  9   9   | 0  1  | 41 | 12 | 0     0     ]
    slots     [ s  s  s  -1  -1  | s  s  | s  | s  | -1    -1    ]
    logits    rows A2 (only if A's prompt ends with this chunk), B1, C0, D0

Padding rows take the pad token id and repeat the last real position; their slot is
-1 so they write no KV, and their outputs are never read.

With LoRA, each row also gets its request's adapter slot (``StepInputs.lora``, -1 for
the base model, padding of a request takes the request's slot, dummies -1); a step
without an adapter row gets ``lora=None`` and runs the base path unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.lora.weights import LoRABatch
from kvserve.model.attention import (
    AttentionMetadata,
    ResolvedBackend,
    SeqSpec,
    build_attention_metadata,
)
from kvserve.model.kernels.backend import KernelBackend
from kvserve.sampling.sampler import SamplingRequestState
from kvserve.sched.output import SchedulerOutput
from kvserve.worker.prompt_logprobs import PromptLogprobsRows, rows_to_score


@dataclass
class CachedRequestState:
    """What the runner remembers about one request between steps.

    ``sampling.output_token_ids`` is the request's generated tokens; the runner
    appends each sampled id after the step, so ``num_tokens`` tracks the scheduler's
    ``Request.num_tokens``.
    """

    req_id: str
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingRequestState
    lora_slot: int = -1  # the adapter's slot (kvserve.lora.weights), -1: the base model

    @property
    def num_tokens(self) -> int:
        return len(self.sampling.prompt_token_ids) + len(self.sampling.output_token_ids)


@dataclass
class StepInputs:
    """The tensors of one step plus which rows to sample from."""

    input_ids: torch.Tensor  # [num_rows] int64
    positions: torch.Tensor  # [num_rows] int64
    attn_meta: AttentionMetadata
    # [num_sampled] int64: last real row of each sampled request (a request with
    # drafts: its last 1 + num_drafts rows)
    logits_rows: torch.Tensor
    sample_req_ids: list[str]  # request ids in logits_rows order
    num_rows: int  # real + padding + dummy rows
    prompt_logprob_rows: list[PromptLogprobsRows]  # requests with prompt_logprobs set
    lora: LoRABatch | None = None  # adapter slot per row; None: no adapter row


class InputBatch:
    """Per-request state across steps; builds the flat, padded inputs of a step."""

    def __init__(
        self,
        *,
        block_size: int,
        num_kv_blocks: int,
        pad_token_id: int,
        eos_token_id: int | None,
        device: torch.device,
        attention_backend: ResolvedBackend = "portable",
        batch_invariant: bool = False,
        kernels: KernelBackend | None = None,
        kv_8bit: bool = False,
        invariant_max_context: int = 0,
        kv_segment_size: int = 0,
    ) -> None:
        self.block_size = block_size
        self.kv_segment_size = kv_segment_size  # the attention kernel's (CacheConfig)
        self.kernels = kernels  # the runner's backend (None: the default one)
        self.kv_8bit = kv_8bit  # 8-bit KV cache: one kernel call over every row
        self.attention_backend: ResolvedBackend = attention_backend
        self.batch_invariant = batch_invariant  # invariant attention (docs/determinism.md)
        self.invariant_max_context = invariant_max_context  # the automatic mode's reach
        self.num_kv_blocks = num_kv_blocks
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}
        # adapter id -> slot (the runner's LoRAManager.slot_of); None: LoRA is off
        self.lora_slot_of: Callable[[str | None], int] | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def update_states(self, so: SchedulerOutput) -> None:
        """Drop finished requests, add new ones, apply the cached requests' diffs.

        Raises RuntimeError when a cached request is unknown or a block id is outside
        ``[1, num_kv_blocks)`` (the scheduler and the runner disagree; the step must not
        run on guessed state).
        """
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self._check_blocks(new.req_id, new.block_ids)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=SamplingRequestState(
                    params=new.sampling_params,
                    prompt_token_ids=list(new.prompt_token_ids),
                    output_token_ids=list(new.output_token_ids),
                    eos_token_id=self.eos_token_id,
                ),
            )
            if new.adapter_id is not None:
                if self.lora_slot_of is None:
                    raise RuntimeError(
                        f"request {new.req_id!r} selects LoRA adapter {new.adapter_id!r} "
                        "but this runner serves no adapters (enable_lora is off)"
                    )
                self.requests[new.req_id].lora_slot = self.lora_slot_of(new.adapter_id)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.requests.get(req_id)
            if state is None:
                raise RuntimeError(
                    f"scheduler sent cached request {req_id!r} that the model runner does "
                    "not know: a request's first step must come in scheduled_new_reqs"
                )
            if new_blocks:
                self._check_blocks(req_id, new_blocks)
                state.block_ids.extend(new_blocks)
            state.num_computed_tokens = num_computed

    def _check_blocks(self, req_id: str, block_ids: list[int]) -> None:
        if block_ids and not (min(block_ids) > 0 and max(block_ids) < self.num_kv_blocks):
            raise RuntimeError(
                f"request {req_id!r} got block ids {block_ids} outside [1, {self.num_kv_blocks})"
            )

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Flat padded inputs for the scheduled requests of ``so`` (after update_states)."""
        prefill_ids: list[str] = []
        single_ids: list[str] = []
        for req_id in so.scheduled_req_ids:
            rows = so.num_scheduled_tokens_padded.get(req_id, so.num_scheduled_tokens[req_id])
            (single_ids if rows == 1 else prefill_ids).append(req_id)
        num_dummy = 0
        if so.decode_batch_size_padded is not None:
            # a decode step: every scheduled request is a decode (rows of 1, or
            # 1 + drafts with speculative decoding); dummies pad the request count
            num_dummy = max(0, so.decode_batch_size_padded - len(so.num_scheduled_tokens))

        input_ids: list[int] = []
        positions: list[int] = []
        specs: list[SeqSpec] = []
        logits_rows: list[int] = []
        sample_req_ids: list[str] = []
        scored: list[PromptLogprobsRows] = []
        row_slots: list[int] = []
        for req_id in prefill_ids + single_ids:
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            rows = max(n, so.num_scheduled_tokens_padded.get(req_id, n))
            start = so.cached_seq_len[req_id]
            tokens = so.scheduled_token_ids[req_id]
            if len(tokens) != n:
                raise RuntimeError(
                    f"request {req_id!r}: {len(tokens)} scheduled token ids for "
                    f"num_scheduled_tokens={n}"
                )
            row = len(input_ids)
            input_ids.extend(tokens)
            positions.extend(range(start, start + n))
            if rows > n:
                input_ids.extend([self.pad_token_id] * (rows - n))
                positions.extend([start + n - 1] * (rows - n))
            specs.append(SeqSpec(row, rows, n, start, state.block_ids))
            row_slots.extend([state.lora_slot] * rows)
            num_top = state.sampling.params.prompt_logprobs
            if num_top is not None:
                prompt = state.sampling.prompt_token_ids
                to_score = rows_to_score(req_id, row, start, n, prompt, num_top)
                if to_score is not None:
                    scored.append(to_score)
            if start + n >= state.num_tokens:  # all its tokens have KV: sample the next
                # with drafts (speculative decoding): one row per draft, and the last
                num_drafts = len(so.scheduled_spec_decode_tokens.get(req_id, ()))
                logits_rows.extend(range(row + n - 1 - num_drafts, row + n))
                sample_req_ids.append(req_id)
        input_ids.extend([self.pad_token_id] * num_dummy)
        positions.extend([0] * num_dummy)

        num_rows = len(input_ids)
        meta = build_attention_metadata(
            specs,
            num_tokens=num_rows,
            num_dummy_decode_rows=num_dummy,
            block_size=self.block_size,
            kv_segment_size=self.kv_segment_size,
            device=self.device,
            backend=self.attention_backend,
            batch_invariant=self.batch_invariant,
            kernels=self.kernels,
            kv_8bit=self.kv_8bit,
            invariant_max_context=self.invariant_max_context,
        )
        dev = self.device
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            attn_meta=meta,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            sample_req_ids=sample_req_ids,
            num_rows=num_rows,
            prompt_logprob_rows=scored,
            lora=(
                LoRABatch.from_row_slots(row_slots, dev) if self.lora_slot_of is not None else None
            ),
        )
