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

import torch

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.kv_transfer.connector import KVConnectorWorker
from kvserve.model.attention import resolve_attention_backend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import LoadedModel
from kvserve.sched.output import Logprobs, ModelRunnerOutput, SchedulerOutput
from kvserve.worker.compiled_step import CompiledDecode
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.sampler import Sampler


def kv_cache_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    """Bytes one KV block takes over all layers (K and V)."""
    cfg = loaded.model.config
    elem = torch.empty((), dtype=loaded.dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def allocate_kv_cache(
    model: LlamaForCausalLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Zeroed cache ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]``.

    ``cache[i]`` is layer ``i``'s view in the layout of ``kvserve.model.attention``.
    """
    cfg = model.config
    return torch.zeros(
        cfg.num_layers,
        2,
        cfg.num_kv_heads,
        num_blocks,
        block_size,
        cfg.head_dim,
        dtype=dtype,
        device=device,
    )


class ModelRunner:
    """Executes scheduled steps on one model; see the module docstring for the cache.

    Rules for callers: pass every ``SchedulerOutput`` exactly once, in order (the
    runner keeps diffs); ``block_ids`` must never point past ``num_kv_blocks``.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        *,
        sampler: Sampler | None = None,
        compile: bool = False,
    ) -> None:
        self.loaded = loaded
        self.model: LlamaForCausalLM = loaded.model
        self.device = loaded.device
        self.block_size = cache_config.block_size
        self.scheduler_config = scheduler_config
        per_block = kv_cache_bytes_per_block(loaded, self.block_size)
        if cache_config.num_kv_blocks is not None:
            num_blocks = int(cache_config.num_kv_blocks)
        else:
            num_blocks = int(cache_config.kv_cache_memory_gib * (1 << 30)) // per_block
        if num_blocks < 2:
            raise ValueError(
                f"invalid kv_cache_memory_gib={cache_config.kv_cache_memory_gib!r}: it holds "
                f"{num_blocks} KV blocks of {per_block} bytes, at least 2 are needed "
                f"(block 0 is the null block) (for example: kv_cache_memory_gib=1.0)"
            )
        self.num_kv_blocks: int = num_blocks
        self.kv_cache = allocate_kv_cache(
            self.model, num_blocks, self.block_size, loaded.dtype, self.device
        )
        self.kv_caches: list[torch.Tensor] = list(self.kv_cache.unbind(0))
        pad = getattr(loaded.hf_config, "pad_token_id", None)
        if not isinstance(pad, int):
            pad = getattr(loaded.tokenizer, "pad_token_id", None)
        self.attention_backend = resolve_attention_backend(loaded.dtype, self.device)
        self.input_batch = InputBatch(
            block_size=self.block_size,
            num_kv_blocks=num_blocks,
            pad_token_id=pad if isinstance(pad, int) else 0,
            eos_token_id=loaded.eos_token_ids[0] if loaded.eos_token_ids else None,
            device=self.device,
            attention_backend=self.attention_backend,
        )
        self.sampler = sampler if sampler is not None else Sampler()
        self.kv_connector: KVConnectorWorker | None = None
        self.compiled: CompiledDecode | None = None
        if compile:
            policy = scheduler_config.scheduler_policy
            self.compiled = CompiledDecode(
                self.model,
                buckets=scheduler_config.num_seqs_buckets if policy == "separated" else None,
                max_model_len=scheduler_config.max_model_len,
                block_size=self.block_size,
                attention_backend=self.attention_backend,
            )
            self.compiled.warm_up(self.kv_caches, scheduler_config.kv_segment_size)

    def set_kv_connector(self, connector: KVConnectorWorker) -> None:
        """Use ``connector``'s worker side around every step (disaggregation)."""
        connector.register_kv_cache(self.kv_cache)
        self.kv_connector = connector

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: returns sampled token ids per scheduled request.

        A request gets ``[token]`` when all its tokens have KV after this step
        (prefill finished or decode), else ``[]`` (mid-prefill); ``logprobs`` holds
        one entry for requests whose params ask for them.
        """
        so = scheduler_output
        batch = self.input_batch
        batch.update_states(so)
        meta = so.kv_connector_metadata
        if meta is not None and self.kv_connector is not None:
            self.kv_connector.load_kv(meta)  # received blocks, before the forward pass
        if so.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        inputs = batch.prepare_inputs(so)
        attn_meta = inputs.attn_meta
        if self.compiled is not None and self.compiled.supports(attn_meta):
            hidden = self.compiled(inputs.input_ids, inputs.positions, self.kv_caches, attn_meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, attn_meta)
        if meta is not None and self.kv_connector is not None:
            self.kv_connector.save_kv(meta)  # blocks this step completed, right after it

        sampled: dict[str, list[int]] = {req_id: [] for req_id in so.scheduled_req_ids}
        logprobs: dict[str, list[Logprobs]] = {}
        if inputs.sample_req_ids:
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_rows))
            states = [batch.requests[r].sampling for r in inputs.sample_req_ids]
            out = self.sampler(logits, states)
            for req_id, state, token_id, lp in zip(
                inputs.sample_req_ids, states, out.token_ids, out.logprobs, strict=True
            ):
                state.output_token_ids.append(token_id)
                sampled[req_id] = [token_id]
                if lp is not None:
                    logprobs[req_id] = [lp]
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)
