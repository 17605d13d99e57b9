"""The two engines ``kvserve bench forward`` drives (:mod:`kvserve.bench.forward`).

:class:`KvserveDriver` runs kvserve's :class:`~kvserve.worker.model_runner.ModelRunner`
with hand-built ``SchedulerOutput``s (no scheduler: block ids are handed out in order
and reused from the start once the pool is exhausted, so a caller must keep at most
one generation of requests live); :class:`HfDriver` runs the HF transformers model with
its own KV cache. Both sample greedily.
"""

from __future__ import annotations

import inspect
from typing import Any


class KvserveDriver:
    """Drives a ModelRunner with hand-built SchedulerOutputs (no scheduler involved)."""

    def __init__(
        self,
        loaded: Any,
        block_size: int,
        kv_segment_size: int,
        num_blocks: int,
        batch_invariant: bool | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        from kvserve.config import CacheConfig, SchedulerConfig
        from kvserve.request import SamplingParams
        from kvserve.worker.model_runner import ModelRunner

        self.runner = ModelRunner(
            loaded,
            CacheConfig(
                block_size=block_size,
                num_kv_blocks=num_blocks,
                kv_cache_dtype=kv_cache_dtype,
                kv_segment_size=kv_segment_size,
            ),
            SchedulerConfig(),
            batch_invariant=batch_invariant,
        )
        self.block_size = block_size
        self.params = SamplingParams(temperature=0.0, max_tokens=None)
        self.next_block = 1
        self.counter = 0
        self.live: dict[str, dict[str, Any]] = {}

    def _blocks(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        if self.next_block + n > self.runner.num_kv_blocks:
            self.next_block = 1  # reuse: old requests are finished by then
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def prefill(self, prompts: list[list[int]], reserve: int = 0) -> dict[str, int]:
        """Admit and prefill ``prompts`` in one step; returns req_id -> sampled token."""
        from kvserve.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        finished = set(self.live)
        self.live.clear()
        new = []
        for p in prompts:
            self.counter += 1
            req_id = f"b{self.counter}"
            blocks = self._blocks(len(p) + reserve)
            new.append(NewRequestData(req_id, list(p), [], blocks, 0, self.params))
            self.live[req_id] = {"len": len(p)}
        so = SchedulerOutput(
            phase="prefill",
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={r.req_id: len(r.prompt_token_ids) for r in new},
            num_scheduled_tokens_padded={r.req_id: len(r.prompt_token_ids) for r in new},
            scheduled_token_ids={r.req_id: list(r.prompt_token_ids) for r in new},
            cached_seq_len={r.req_id: 0 for r in new},
            finished_req_ids=finished,
        )
        out = self.runner.execute_model(so)
        last = {r: out.sampled_token_ids[r][0] for r in self.live}
        for r, tok in last.items():
            self.live[r]["last"] = tok
        for r, req in zip(self.live, new, strict=True):
            self.live[r]["blocks"] = req.block_ids
        return last

    def prefill_cached(self, prompt: list[int], cached: int, blocks: list[int]) -> None:
        """One step prefilling ``prompt[cached:]`` as a new request whose first
        ``cached`` tokens are a prefix-cache hit: their KV must already be in the first
        blocks of ``blocks`` (which cover the whole prompt)."""
        from kvserve.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        finished = set(self.live)
        self.live.clear()
        self.counter += 1
        req_id = f"b{self.counter}"
        new = NewRequestData(req_id, list(prompt), [], list(blocks), cached, self.params)
        n = len(prompt) - cached
        so = SchedulerOutput(
            phase="prefill",
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={req_id: n},
            num_scheduled_tokens_padded={req_id: n},
            scheduled_token_ids={req_id: list(prompt[cached:])},
            cached_seq_len={req_id: cached},
            finished_req_ids=finished,
        )
        out = self.runner.execute_model(so)
        self.live[req_id] = {"len": len(prompt), "last": out.sampled_token_ids[req_id][0]}

    def decode_step(self) -> None:
        from kvserve.sched.output import CachedRequestData, SchedulerOutput

        ids = list(self.live)
        so = SchedulerOutput(
            phase="decode",
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(
                ids, [[] for _ in ids], [self.live[r]["len"] for r in ids]
            ),
            num_scheduled_tokens={r: 1 for r in ids},
            num_scheduled_tokens_padded={r: 1 for r in ids},
            scheduled_token_ids={r: [self.live[r]["last"]] for r in ids},
            cached_seq_len={r: self.live[r]["len"] for r in ids},
        )
        out = self.runner.execute_model(so)
        for r in ids:
            self.live[r]["len"] += 1
            self.live[r]["last"] = out.sampled_token_ids[r][0]


class HfDriver:
    def __init__(self, model_dir: Any, dtype: Any) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.cache: Any = None
        self.next_ids: Any = None
        params = inspect.signature(self.model.forward).parameters
        # transformers >= 5.2x calls the KV cache ``cache``; older ones ``past_key_values``
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def prefill(self, prompts: list[list[int]]) -> None:
        import torch

        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = self.model(ids, use_cache=True, logits_to_keep=1)
        self.cache = hf_cache(out)
        self.next_ids = out.logits[:, -1].argmax(-1, keepdim=True)

    def decode_step(self) -> None:
        import torch

        with torch.inference_mode():
            out = self.model(self.next_ids, past_key_values=self.cache, use_cache=True)
        self.cache = hf_cache(out)
        self.next_ids = out.logits[:, -1].argmax(-1, keepdim=True)


def hf_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
