"""Turn a :class:`SchedulerOutput` into one forward pass and sampled tokens.

The runner owns the paged KV cache and the per-request state; it makes no
scheduling decision. KV cache: one preallocated tensor ::

    kv_cache: [num_layers, 2, num_kv_heads, num_kv_blocks, block_size, head_dim]
              layer i's view kv_cache[i] is [2 (K, V), Hk, blocks, block_size, D]
              (head-major; see kvserve.model.attention)

``num_kv_blocks`` (the null block 0 included) comes from ``CacheConfig.num_kv_blocks``
or, when that is None, from ``CacheConfig.kv_cache_memory_gib``; the engine builds its
block pool from :attr:`ModelRunner.num_kv_blocks`.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.kv_transfer.connector import KVConnectorWorker
from kvserve.lora.config import LoRAConfig
from kvserve.lora.manager import LoRAManager
from kvserve.lora.weights import LoRAWeights
from kvserve.model.attention import resolve_attention_backend
from kvserve.model.invariance import auto_invariant_reach
from kvserve.model.kernels.kv8 import kv_cache_fingerprint, resolve_kv_cache_dtype
from kvserve.model.kv_cache_tensor import allocate_kv_cache as allocate_kv_cache  # re-exported
from kvserve.model.kv_cache_tensor import kv_cache_bytes_per_block as kv_cache_bytes_per_block
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import LoadedModel
from kvserve.sampling.sampler import Sampler, SamplerOutput, SamplingRequestState
from kvserve.sched import decode_batch_buckets
from kvserve.sched.cost_model import CostModel
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.spec_decode.decoder import History, SpecDecoder
from kvserve.spec_decode.factory import build_spec_decoder
from kvserve.spec_decode.verify import draft_states, num_accepted, verify_sampled
from kvserve.speculative_config import SpeculativeConfig
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.matcher import StructuredBatch
from kvserve.worker.compiled_step import CompiledDecode
from kvserve.worker.input_batch import InputBatch, StepInputs
from kvserve.worker.invariance_mode import resolve_auto_invariance, resolve_batch_invariant
from kvserve.worker.prompt_logprobs import score

logger = logging.getLogger(__name__)

# The KV cache a default start gets (CacheConfig with neither num_kv_blocks nor
# kv_cache_memory_gib): room for AUTO_KV_TOKENS tokens, at least AUTO_KV_MIN_BYTES,
# at most AUTO_KV_MAX_FRACTION of the memory available once the weights are loaded.
AUTO_KV_TOKENS = 32768
AUTO_KV_MIN_BYTES = 1 << 30
AUTO_KV_MAX_FRACTION = 0.5


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def auto_kv_cache_bytes(bytes_per_token: int, weight_bytes: int) -> tuple[int, str]:
    """(KV cache bytes, the reason in words) for a default start: ``AUTO_KV_TOKENS``
    tokens' worth, at least ``AUTO_KV_MIN_BYTES``, at most ``AUTO_KV_MAX_FRACTION`` of
    ``/proc/meminfo``'s MemAvailable less ``weight_bytes`` (weights mapped from the
    page cache count as available there, so they are taken off once more; weights in
    anonymous memory are thereby counted twice, which only lowers the ceiling)."""
    want = max(AUTO_KV_MIN_BYTES, AUTO_KV_TOKENS * bytes_per_token)
    avail = _mem_available()
    if avail is None:
        return want, f"room for {AUTO_KV_TOKENS} tokens, at least 1 GiB; memory unknown"
    left = max(0, avail - weight_bytes)
    cap = int(AUTO_KV_MAX_FRACTION * left)
    why = (
        f"room for {AUTO_KV_TOKENS} tokens, at least 1 GiB, at most "
        f"{AUTO_KV_MAX_FRACTION:.0%} of the {left / (1 << 30):.1f} GiB available after the weights"
    )
    return max(min(want, cap), min(want, 64 << 20)), why


class ModelRunner:
    """Executes scheduled steps on one model; see the module docstring for the cache.

    Rules for callers: pass every ``SchedulerOutput`` exactly once, in order (the
    runner keeps diffs); ``block_ids`` must never point past ``num_kv_blocks``.
    ``grammar_compiler`` (optional) serves requests with structured outputs; without
    one their params are refused by the engine before they get here.
    ``batch_invariant``: see :func:`resolve_batch_invariant`; it sets the model's linear
    routing (``model.set_batch_invariant``), so runners sharing one model must agree.
    ``lora_config`` with ``enable_lora``: the runner builds the adapter slots on its
    model and owns the :class:`LoRAManager` (``self.lora_manager``; None when off).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        *,
        sampler: Sampler | None = None,
        compile: bool = False,
        grammar_compiler: GrammarCompiler | None = None,
        speculative_config: SpeculativeConfig | None = None,
        batch_invariant: bool | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.loaded = loaded
        self.model: LlamaForCausalLM = loaded.model
        self.device = loaded.device
        self.block_size = cache_config.block_size
        self.kv_segment_size = cache_config.kv_segment_size  # attention's, not the scheduler's
        self.scheduler_config = scheduler_config
        self.kv_format = resolve_kv_cache_dtype(cache_config.kv_cache_dtype, loaded.dtype)
        per_block = kv_cache_bytes_per_block(loaded, self.block_size, self.kv_format)
        if cache_config.num_kv_blocks is not None:
            num_blocks = int(cache_config.num_kv_blocks)
        elif cache_config.kv_cache_memory_gib is not None:
            num_blocks = int(cache_config.kv_cache_memory_gib * (1 << 30)) // per_block
        else:
            weights = int(self.model.weight_bytes()) if hasattr(self.model, "weight_bytes") else 0
            budget, why = auto_kv_cache_bytes(per_block // self.block_size, weights)
            num_blocks = max(2, budget // per_block)
            logger.info(
                "KV cache sized automatically: %.2f GiB, %d blocks = %d tokens (%s); "
                "max_num_seqs %d; --kv-cache-memory-gib or --num-kv-blocks choose it",
                num_blocks * per_block / (1 << 30),
                num_blocks,
                (num_blocks - 1) * self.block_size,
                why,
                scheduler_config.max_num_seqs,
            )
        if num_blocks < 2:
            raise ValueError(
                f"invalid kv_cache_memory_gib={cache_config.kv_cache_memory_gib!r}: it holds "
                f"{num_blocks} KV blocks of {per_block} bytes, at least 2 are needed "
                f"(block 0 is the null block) (for example: kv_cache_memory_gib=1.0)"
            )
        self.num_kv_blocks: int = num_blocks
        self.kv_cache_lazy = cache_config.kv_cache_commit == "lazy"
        self.kv_cache = allocate_kv_cache(
            self.model,
            num_blocks,
            self.block_size,
            loaded.dtype,
            self.device,
            self.kv_format,
            lazy=self.kv_cache_lazy,
        )
        self.kv_caches: list[torch.Tensor] = list(self.kv_cache.unbind(0))
        pad = getattr(loaded.hf_config, "pad_token_id", None)
        if not isinstance(pad, int):
            pad = getattr(loaded.tokenizer, "pad_token_id", None)
        # the kernel families, chosen once when the model was prepared; passed down to the
        # attention metadata and the sampler (docs/kernels.md)
        self.kernels = self.model.kernels
        self.attention_backend = resolve_attention_backend(loaded.dtype, self.device, self.kernels)
        if self.kv_format.is_8bit and self.attention_backend != "native":
            raise ValueError(
                f"invalid kv_cache_dtype={self.kv_format.name!r}: an 8-bit KV cache needs "
                "kvserve's native CPU kernels (a C++ compiler, device cpu, KVSERVE_ATTENTION "
                "not 'portable') (for example: --kv-cache-dtype auto)"
            )
        self.batch_invariant = resolve_batch_invariant(
            batch_invariant, self.model, self.attention_backend, compile
        )
        self.invariant_max_context = resolve_auto_invariance(
            batch_invariant, self.model, self.attention_backend, compile
        )
        if self.invariant_max_context and not self.kv_format.is_8bit:
            self.invariant_max_context = auto_invariant_reach(
                self.kernels,
                loaded.dtype,
                self.model.config.head_dim,
                self.block_size,
                self.kv_segment_size,
            )
        self.model.set_batch_invariant(self.batch_invariant or self.invariant_max_context > 0)
        self.input_batch = InputBatch(
            block_size=self.block_size,
            num_kv_blocks=num_blocks,
            pad_token_id=pad if isinstance(pad, int) else 0,
            eos_token_id=loaded.eos_token_ids[0] if loaded.eos_token_ids else None,
            device=self.device,
            attention_backend=self.attention_backend,
            batch_invariant=self.batch_invariant,
            kernels=self.kernels,
            kv_8bit=self.kv_format.is_8bit,
            invariant_max_context=self.invariant_max_context,
            kv_segment_size=self.kv_segment_size,
        )
        self.lora_manager: LoRAManager | None = None
        self.model.lora_weights = None  # a model reused from an earlier engine keeps none
        if lora_config is not None and lora_config.enable_lora:
            self.lora_manager = self._build_lora(lora_config)
        self.sampler = sampler if sampler is not None else Sampler(kernels=self.kernels)
        self.kv_connector: KVConnectorWorker | None = None
        self.structured = StructuredBatch(grammar_compiler) if grammar_compiler else None
        self.compiled: CompiledDecode | None = None
        self.spec_decoder: SpecDecoder | None = None
        if speculative_config is not None:
            self.spec_decoder = build_spec_decoder(speculative_config, loaded, cache_config)
            self.spec_decoder.attach_target(self.kv_cache, self._target_block_ids)
        if compile:
            self.compiled = CompiledDecode(
                self.model,
                buckets=decode_batch_buckets(scheduler_config),
                max_model_len=scheduler_config.model_len,
                block_size=self.block_size,
                attention_backend=self.attention_backend,
            )
            self.compiled.warm_up(
                self.kv_caches, self.kv_segment_size, loaded.dtype, self.kv_format.is_8bit
            )

    def _build_lora(self, config: LoRAConfig) -> LoRAManager:
        """The adapter slots on the model, the manager, and the ``--lora-modules``."""
        from kvserve.lora.ops import native_lora_kernel

        config.validate()
        # slot tensors in the model's dtype where it is bfloat16 (half the bytes a decode
        # step reads), float32 otherwise
        lora_dtype = torch.bfloat16 if self.loaded.dtype == torch.bfloat16 else torch.float32
        weights = LoRAWeights(
            self.model.config,
            config.max_loras,
            config.max_lora_rank,
            device=self.device,
            dtype=lora_dtype,
        )
        weights.native = native_lora_kernel()
        self.model.lora_weights = weights
        manager = LoRAManager(config, self.model.config, weights)
        for name, path in config.lora_modules:
            manager.load(name, path)
        self.input_batch.lora_slot_of = manager.slot_of
        return manager

    def set_kv_connector(self, connector: KVConnectorWorker) -> None:
        """Use ``connector``'s worker side around every step (disaggregation)."""
        connector.register_kv_cache(self.kv_cache)
        self.kv_connector = connector

    def kv_fingerprint(self, model_fingerprint: str) -> str:
        """The block-hash salt of this cache's KV format (``KVFormatRunner``)."""
        return kv_cache_fingerprint(model_fingerprint, self.kv_format, self.loaded.dtype)

    def step_cost_model(self, vocab_size: int, max_model_len: int) -> CostModel:
        """The step-time model fitted from timed steps of this runner (``CostedRunner``;
        cached per model and shapes, :mod:`kvserve.worker.step_cost`)."""
        from kvserve.worker.step_cost import cached_calibration

        return cached_calibration(self, vocab_size=vocab_size, max_model_len=max_model_len)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: returns sampled token ids per scheduled request.

        Block copies (forked samples) run first. A request gets ``[token]`` when all
        its tokens have KV after this step (prefill finished or decode), else ``[]``
        (mid-prefill); each fork of it gets its own first token from the same logits
        row. ``logprobs`` holds one entry for requests whose params ask for them,
        ``prompt_logprobs`` the scored rows of requests with ``prompt_logprobs``.
        """
        so = scheduler_output
        if self.spec_decoder is not None:
            self.spec_decoder.begin_step(so)  # times the step (spec_decode/gain.py)
        batch = self.input_batch
        self._copy_blocks(so.block_copies)
        if self.structured is not None:
            for req_id in so.finished_req_ids:
                self.structured.drop(req_id)
        if self.spec_decoder is not None:
            for req_id in so.finished_req_ids:
                self.spec_decoder.drop(req_id)
        batch.update_states(so)
        kv_meta = so.kv_connector_metadata
        if kv_meta is not None and self.kv_connector is not None:
            self.kv_connector.load_kv(kv_meta)  # received blocks, before the forward pass
        if self.structured is not None:
            for new in so.scheduled_new_reqs:
                self.structured.add(new.req_id, new.sampling_params, new.output_token_ids)
        if so.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        inputs = batch.prepare_inputs(so)
        masks = None
        if self.structured is not None:  # filled on the mask thread during the forward
            masks = self.structured.start_masks(inputs.sample_req_ids)
        attn_meta = inputs.attn_meta
        if inputs.lora is None and self.compiled is not None and self.compiled.supports(attn_meta):
            hidden = self.compiled(inputs.input_ids, inputs.positions, self.kv_caches, attn_meta)
        else:
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, attn_meta, inputs.lora
            )
        if kv_meta is not None and self.kv_connector is not None:
            self.kv_connector.save_kv(kv_meta)  # blocks this step completed, right after it

        out = ModelRunnerOutput(
            sampled_token_ids={req_id: [] for req_id in so.scheduled_req_ids},
            prompt_logprobs={
                rows.req_id: (rows.start, score(hidden, rows, self.model.compute_logits))
                for rows in inputs.prompt_logprob_rows
            },
        )
        if inputs.sample_req_ids:
            mask = masks.result() if masks else None
            if so.scheduled_spec_decode_tokens:
                self._sample_verify(so, inputs, hidden, mask, out)
            else:
                self._sample(so, inputs, hidden, mask, out)
            if self.spec_decoder is not None:
                self._propose(inputs.sample_req_ids, out)
        if self.structured is not None:
            out.failed = self.structured.take_failures()
        return out

    def _target_block_ids(self, req_id: str) -> list[int] | None:
        """A request's block table now (the draft model copies its K/V rows)."""
        state = self.input_batch.requests.get(req_id)
        return state.block_ids if state is not None else None

    def _propose(self, req_ids: list[str], out: ModelRunnerOutput) -> None:
        """Draft tokens for the next step of the requests that sampled this step."""
        assert self.spec_decoder is not None
        batch = self.input_batch
        ids = [r for r in req_ids if batch.requests[r].sampling.params.structured_outputs is None]
        states = [batch.requests[r].sampling for r in ids]
        histories = [History(s.prompt_token_ids, s.output_token_ids) for s in states]
        out.spec_token_ids = self.spec_decoder.propose(ids, histories, states)

    def _sample_verify(
        self,
        so: SchedulerOutput,
        inputs: StepInputs,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        out: ModelRunnerOutput,
    ) -> None:
        """:meth:`_sample` for a step with draft tokens: every logits row of a request
        with drafts is sampled and the drafts verified (kvserve.spec_decode.verify);
        the blocks that held only rejected drafts leave the request's block table,
        as they leave the scheduler's (``cdiv(kept tokens, block_size)`` blocks stay)."""
        batch = self.input_batch
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_rows))
        drafts_of = so.scheduled_spec_decode_tokens
        states: list[SamplingRequestState] = []
        rows: list[int] = []  # logits row of each entry
        mask_rows: list[int] = []  # mask row (one per request) of each entry
        spans: list[tuple[str, int, int]] = []  # req id, first entry, entries
        forks: list[tuple[str, int]] = []  # fork id, entry
        row = 0
        for i, req_id in enumerate(inputs.sample_req_ids):
            state = batch.requests[req_id].sampling
            drafts = drafts_of.get(req_id, [])
            own = draft_states(state, drafts)
            spans.append((req_id, len(states), len(own)))
            states.extend(own)
            rows.extend(range(row, row + len(own)))
            mask_rows.extend([i] * len(own))
            row += len(own)
            for fork in so.forks.get(req_id, ()):
                forks.append((fork.req_id, len(states)))
                states.append(
                    SamplingRequestState(
                        params=fork.sampling_params,
                        prompt_token_ids=state.prompt_token_ids,
                        output_token_ids=[],
                        eos_token_id=state.eos_token_id,
                    )
                )
                rows.append(row - 1)
                mask_rows.append(i)
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        if mask is not None:
            mask = mask.index_select(0, torch.tensor(mask_rows, device=mask.device))
        result = self.sampler(logits, states, token_mask=mask)
        if self.structured is not None and self.structured.budgets:
            fork_entries = {k for _, k in forks}
            owners = [inputs.sample_req_ids[i] for i in mask_rows]
            self._vet(owners, [k not in fork_entries for k in range(len(owners))], logits, result)
        bs = self.block_size
        for req_id, first, count in spans:
            samples = result.token_ids[first : first + count]
            drafts = drafts_of.get(req_id, [])
            m = num_accepted(samples, drafts) if drafts else 0
            tokens = samples[: m + 1]
            q = self._draft_probs(req_id, drafts, states[first].params.logprobs)
            if q is not None:  # sampled drafts: rejection sampling against their q
                span_mask = mask[first : first + count] if mask is not None else None
                tokens = verify_sampled(
                    self.sampler, logits[first : first + count], states[first : first + count],
                    drafts, q, span_mask,
                )  # fmt: skip
                m = len(tokens) - 1
            out.sampled_token_ids[req_id] = tokens
            lps = result.logprobs[first : first + m + 1]
            if lps[0] is not None:
                out.logprobs[req_id] = [lp for lp in lps if lp is not None]
            cached = batch.requests[req_id]
            cached.sampling.output_token_ids.extend(tokens)
            if drafts:
                kept = so.cached_seq_len[req_id] + 1 + m  # tokens with valid KV
                del cached.block_ids[-(-kept // bs) :]
                if self.spec_decoder is not None:
                    self.spec_decoder.observe(req_id, len(drafts), m)
            if self.structured is not None:
                for token_id in tokens:
                    self.structured.accept(req_id, token_id)
        for fork_id, k in forks:
            out.sampled_token_ids[fork_id] = [result.token_ids[k]]
            lp = result.logprobs[k]
            if lp is not None:
                out.logprobs[fork_id] = [lp]

    def _draft_probs(
        self, req_id: str, drafts: list[int], logprobs: int | None
    ) -> torch.Tensor | None:
        """The draft distributions of sampled drafts (spec_decode/verify.py); None:
        sample-and-match (fixed drafts, or logprobs asked: they report the row's sample)."""
        if not drafts or self.spec_decoder is None:
            return None
        q = self.spec_decoder.draft_probs(req_id, drafts)
        return q if logprobs is None else None

    def _sample(
        self,
        so: SchedulerOutput,
        inputs: StepInputs,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        out: ModelRunnerOutput,
    ) -> None:
        """Sample every request whose tokens all have KV, and each of its forks from
        the same logits row (a fork's state: the prompt, no outputs, its own params)."""
        batch = self.input_batch
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_rows))
        req_ids = list(inputs.sample_req_ids)
        states = [batch.requests[r].sampling for r in req_ids]
        rows = list(range(len(req_ids)))
        for i, req_id in enumerate(inputs.sample_req_ids):
            for fork in so.forks.get(req_id, ()):
                leader = states[i]
                rows.append(i)
                req_ids.append(fork.req_id)
                states.append(
                    SamplingRequestState(
                        params=fork.sampling_params,
                        prompt_token_ids=leader.prompt_token_ids,
                        output_token_ids=[],
                        eos_token_id=leader.eos_token_id,
                    )
                )
        if len(rows) > logits.shape[0]:
            index = torch.tensor(rows, device=logits.device)
            logits = logits.index_select(0, index)
            mask = mask.index_select(0, index.to(mask.device)) if mask is not None else None
        result = self.sampler(logits, states, token_mask=mask)
        num_own = len(inputs.sample_req_ids)
        if self.structured is not None and self.structured.budgets:
            owners = [inputs.sample_req_ids[i] for i in rows]
            self._vet(owners, [k < num_own for k in range(len(owners))], logits, result)
        for k, (req_id, state, token_id, lp) in enumerate(
            zip(req_ids, states, result.token_ids, result.logprobs, strict=True)
        ):
            out.sampled_token_ids[req_id] = [token_id]
            if lp is not None:
                out.logprobs[req_id] = [lp]
            if k < num_own:  # a fork's state is built when it arrives as a new request
                state.output_token_ids.append(token_id)
                if self.structured is not None:
                    self.structured.accept(req_id, token_id)

    def _vet(
        self, owners: list[str], own: list[bool], logits: torch.Tensor, result: SamplerOutput
    ) -> None:
        """Keep constrained outputs that must end within max_tokens on a complete
        path (``StructuredBatch.vet``): entry ``k`` of ``result`` (sampled from
        ``logits[k]`` for ``owners[k]``, or a fork of it) may be replaced by the
        closing plan's next token; its logprob is then that token's."""
        assert self.structured is not None
        for k, owner in enumerate(owners):
            forced = self.structured.vet(owner, result.token_ids[k], own=own[k])
            if forced is None:
                continue
            result.token_ids[k] = forced
            lp = result.logprobs[k]
            if lp is not None:
                row = torch.log_softmax(logits[k].float(), dim=-1)
                result.logprobs[k] = dataclasses.replace(lp, sampled_logprob=float(row[forced]))

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (all layers, K and V): ``dst <- src`` for each pair."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.kv_cache.device)
        dst = torch.tensor([c[1] for c in copies], device=self.kv_cache.device)
        # kv_cache: [layers, 2, Hk, blocks, block_size, D]; blocks are dim 3
        self.kv_cache.index_copy_(3, dst, self.kv_cache.index_select(3, src))
