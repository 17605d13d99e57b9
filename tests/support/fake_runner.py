"""A fake model runner for the server tests: the real :class:`EngineCore` (scheduler,
KV cache manager, detokenizer) on a runner that needs no weights."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from kvserve.config import AdmissionConfig, CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.sched.output import Logprobs, ModelRunnerOutput, SchedulerOutput

POISON_TOKEN = 13  # a prompt containing this token id makes the runner's step fail
NUM_KV_BLOCKS = 1000


@dataclass
class FakeModel:
    """The model facts the engine reads (``kvserve.engine.runner.ModelInfo``)."""

    tokenizer: Any
    max_model_len: int = 256
    name: str = "fake-model"
    fingerprint: str = "fake"
    dtype_name: str = "none"

    @property
    def eos_token_ids(self) -> list[int]:
        return [2]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


class FakeRunner:
    """Samples token ``(last prompt token + k + 1) % 200 + 100`` as a request's k-th
    output (never EOS), with made-up logprobs when asked. A step that schedules a
    request whose prompt contains ``POISON_TOKEN`` raises, as a broken model would.
    Each step sleeps ``step_s``; clear ``gate`` to block the engine thread in its
    next step."""

    attention_backend = "none"

    def __init__(self, *, step_s: float = 0.002, num_kv_blocks: int = NUM_KV_BLOCKS) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.step_s = step_s
        self.gate = threading.Event()
        self.gate.set()
        self.num_steps = 0
        self.step_sizes: list[int] = []  # requests scheduled in each step
        self._prompts: dict[str, list[int]] = {}
        self._num_outputs: dict[str, int] = {}
        self._num_logprobs: dict[str, int | None] = {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        self.gate.wait()
        time.sleep(self.step_s)
        self.num_steps += 1
        self.step_sizes.append(len(so.num_scheduled_tokens))
        for r in so.finished_req_ids:
            self._prompts.pop(r, None)
        for new in so.scheduled_new_reqs:
            self._prompts[new.req_id] = list(new.prompt_token_ids)
            self._num_outputs[new.req_id] = len(new.output_token_ids)
            self._num_logprobs[new.req_id] = new.sampling_params.logprobs
        if any(POISON_TOKEN in self._prompts[r] for r in so.num_scheduled_tokens):
            raise RuntimeError("fake model failure")
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[Logprobs]] = {}
        for r, n in so.num_scheduled_tokens.items():
            prompt = self._prompts[r]
            if so.cached_seq_len[r] + n < len(prompt) + self._num_outputs[r]:
                sampled[r] = []  # mid-prefill
                continue
            tok = (prompt[-1] + self._num_outputs[r] + 1) % 200 + 100
            self._num_outputs[r] += 1
            sampled[r] = [tok]
            k = self._num_logprobs[r]
            if k is not None:
                logprobs[r] = [Logprobs(-0.5, [tok, tok + 1, tok + 2][:k], [-0.5, -1.5, -2.5][:k])]
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def fake_engine(
    tokenizer: Any,
    *,
    max_model_len: int = 256,
    max_num_seqs: int = 8,
    step_s: float = 0.002,
    batch_wait_ms: float = 0.0,
) -> tuple[EngineCore, FakeRunner]:
    """A real EngineCore on a :class:`FakeRunner`; returns both. No burst wait unless
    ``batch_wait_ms`` is given (the tests time their own arrivals)."""
    runner = FakeRunner(step_s=step_s)
    config = EngineConfig(
        cache=CacheConfig(num_kv_blocks=runner.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
        admission=AdmissionConfig(batch_wait_ms=batch_wait_ms),
    )
    model = FakeModel(tokenizer, max_model_len=max_model_len)
    return EngineCore(config, loaded=model, runner=runner), runner
