"""A small stand-in for :class:`EngineCore` for the server tests (no model weights)."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.engine_core import EngineCore
from kvserve.engine.outputs import RequestDelta
from kvserve.request import SamplingParams
from kvserve.sched.output import Logprobs

# --------------------------------------------------------------------- engine double
POISON_TOKEN = 13  # a prompt containing this token id makes the fake engine's step fail


@dataclass
class _FakeReq:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    out: list[int] = field(default_factory=list)


class FakeEngineCore:
    """A stand-in for :class:`EngineCore` with the same surface the server uses.

    Each step emits one token per running request (at most ``max_num_seqs`` run,
    the rest wait); token k of a request is ``(last prompt token + k + 1) % 200 +
    100``. Each request holds ``ceil(tokens / 16)`` "blocks". A prompt containing
    ``POISON_TOKEN`` makes ``step`` raise, as a broken model would.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int = 256,
        max_num_seqs: int = 8,
        step_s: float = 0.002,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = [2]
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.reqs: dict[str, _FakeReq] = {}
        self.order: list[str] = []
        self.num_steps = 0
        self.num_failed_steps = 0
        self.gate = threading.Event()  # cleared: step() blocks (to hold requests waiting)
        self.gate.set()

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        EngineCore.validate_request(self, prompt_token_ids, params)  # type: ignore[arg-type]

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        self.validate_request(prompt_token_ids, params)
        assert request_id is not None and request_id not in self.reqs
        if params.max_tokens is None:
            params = dataclasses.replace(
                params, max_tokens=self.max_model_len - len(prompt_token_ids)
            )
        self.reqs[request_id] = _FakeReq(request_id, list(prompt_token_ids), params, cache_salt)
        self.order.append(request_id)
        return request_id

    def abort_requests(self, req_ids: list[str] | str) -> None:
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        for r in req_ids:
            if r in self.reqs:
                del self.reqs[r]
                self.order.remove(r)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def running(self) -> list[str]:
        return self.order[: self.max_num_seqs]

    def step(self) -> list[RequestDelta]:
        self.gate.wait()
        time.sleep(self.step_s)
        self.num_steps += 1
        running = self.running()
        if any(POISON_TOKEN in self.reqs[r].prompt for r in running):
            raise RuntimeError("fake model failure")
        deltas = []
        for r in running:
            req = self.reqs[r]
            tok = (req.prompt[-1] + len(req.out) + 1) % 200 + 100
            req.out.append(tok)
            lps = []
            if req.params.logprobs is not None:
                n = req.params.logprobs
                lps = [Logprobs(-0.5, [tok, tok + 1, tok + 2][:n], [-0.5, -1.5, -2.5][:n])]
            finished = len(req.out) >= (req.params.max_tokens or 16)
            deltas.append(
                RequestDelta(
                    request_id=r,
                    new_token_ids=[tok],
                    new_text=self.tokenizer.decode([tok]),
                    new_logprobs=lps,
                    finish_reason="length" if finished else None,
                    num_prompt_tokens=len(req.prompt),
                    num_cached_tokens=0,
                    num_output_tokens=len(req.out),
                )
            )
            if finished:
                self.abort_requests(r)
        return deltas

    def stats(self) -> dict[str, Any]:
        running = self.running()
        active = sum(-(-(len(q.prompt) + len(q.out)) // 16) for q in self.reqs.values())
        return {
            "num_requests_running": len(running),
            "num_requests_waiting": len(self.order) - len(running),
            "kv_cache_usage_perc": active / 1000,
            "num_active_blocks": active,
            "num_reclaimable_blocks": 0,
            "num_empty_blocks": 1000 - active,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "num_preemptions": 0,
            "total_padding_tokens": 0,
            "scheduler_state": "ACTIVE_DECODE" if running else "IDLE",
            "num_failed_steps": self.num_failed_steps,
        }
