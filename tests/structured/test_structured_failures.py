"""A grammar that cannot be followed is a 400 at compile time; a matcher that fails
mid-generation ends the request with an error (an error event then [DONE], or a 500),
never a normal "stop" (issue 21 item 6)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from support.fake_runner import FakeModel, FakeRunner
from support.server_helpers import scrape, serve_thread

from kvserve.config import AdmissionConfig, CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine_core import EngineCore
from kvserve.entrypoints.openai_server import build_app
from kvserve.request import FinishReason, RequestError, SamplingParams
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.matcher import StructuredBatch
from kvserve.structured.params import StructuredOutputsParams

FAIL_TOKEN = 17  # a prompt holding it: the runner reports its matcher failed


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (StructuredOutputsParams(regex="a{1000000}"), "structured_outputs.regex"),
        (StructuredOutputsParams(json={"$ref": "#"}), "structured_outputs.json"),
        (
            StructuredOutputsParams(
                json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
            ),
            "structured_outputs.json",
        ),
    ],
)
def test_unsatisfiable_constraints_refused_at_compile_time(
    compiler: GrammarCompiler, params: StructuredOutputsParams, field: str
) -> None:
    with pytest.raises(RequestError) as info:
        compiler.check(params)
    assert info.value.param == field


def test_recursive_but_satisfiable_schema_still_compiles(compiler: GrammarCompiler) -> None:
    compiler.check(
        StructuredOutputsParams(json={"type": "object", "properties": {"next": {"$ref": "#"}}})
    )
    compiler.check(StructuredOutputsParams(regex="a{3}"))


def _raw(compiler: GrammarCompiler, params: StructuredOutputsParams) -> Any:
    """A matcher built without the compile-time probe (as a deeper failure would be)."""
    from llguidance import LLMatcher

    from kvserve.structured.compiler import grammar_text as _grammar

    return LLMatcher(compiler._llg_tokenizer(), _grammar(params), log_level=0)


def test_batch_reports_a_matcher_with_no_allowed_token(compiler: GrammarCompiler) -> None:
    batch = StructuredBatch(compiler)
    batch.matchers["r"] = _raw(compiler, StructuredOutputsParams(json={"$ref": "#"}))
    pending = batch.start_masks(["r", "free"])
    assert pending is not None
    mask = pending.result()
    assert mask[0].sum() == 1 and mask[1].all()
    failures = batch.take_failures()
    assert list(failures) == ["r"] and "mid-generation" in failures["r"]
    assert batch.take_failures() == {}


def test_batch_reports_a_matcher_that_fails_on_a_token(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    batch = StructuredBatch(compiler)
    batch.matchers["r"] = _raw(compiler, StructuredOutputsParams(regex="a{1000000}"))
    pending = batch.start_masks(["r"])
    assert pending is not None
    mask = pending.result()
    batch.accept("r", int(mask[0].nonzero()[0]))
    assert "r" in batch.take_failures()
    batch.drop("r")
    assert not batch.matchers


class _FailingRunner(FakeRunner):
    """The fake runner, reporting a matcher failure for prompts holding FAIL_TOKEN
    from their third sampled token on."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute_model(scheduler_output)
        for r, toks in out.sampled_token_ids.items():
            if toks and FAIL_TOKEN in self._prompts[r] and self._num_outputs[r] >= 3:
                out.failed[r] = "structured outputs failed mid-generation: test"
        return out


def test_matcher_failure_ends_with_an_error_not_stop(tokenizer: Any) -> None:
    runner = _FailingRunner()
    config = EngineConfig(
        cache=CacheConfig(num_kv_blocks=runner.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
        admission=AdmissionConfig(batch_wait_ms=0),
    )
    core = EngineCore(config, loaded=FakeModel(tokenizer), runner=runner)
    request_id = core.add_request([5, FAIL_TOKEN], SamplingParams(max_tokens=20))
    deltas = []
    while core.has_unfinished_requests():
        deltas += [d for d in core.step() if d.request_id == request_id]
    assert deltas[-1].finish_reason == FinishReason.ERROR and deltas[-1].error
    assert sum(len(d.new_token_ids) for d in deltas) == 2  # the failing token is dropped
    core.check_no_leaks()

    with serve_thread(build_app(AsyncEngine(core))) as url:
        body = {"prompt": [5, FAIL_TOKEN], "max_tokens": 20}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "mid-generation" in r.json()["error"]["message"]
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "mid-generation" in events[-2]
        reasons = [
            c["finish_reason"] for e in events[:-2] for c in json.loads(e).get("choices", [])
        ]
        assert "stop" not in reasons
        ok = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
        assert ok.status_code == 200
        stats = scrape(url)
    assert stats["kvserve:num_requests_running"] == 0
    assert stats["kvserve:num_requests_waiting"] == 0
    assert stats["kvserve:num_active_blocks"] == 0
