"""kvserve.engine.output_processor: a scheduler output becomes a RequestDelta with its
text; a stop string finishes the request in the scheduler; the first delta carries
the prompt logprobs. End to end through the model: tests/engine/test_engine_e2e.py
(test_stops_and_text, test_stop_token_text_is_trimmed)."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.output_processor import RequestState, process_output
from kvserve.request import FinishReason, Request, RequestStatus, SamplingParams
from kvserve.sched.output import EngineCoreOutput


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvserve.model.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


class _Scheduler:
    """Records what process_output finishes (the one scheduler call it makes)."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, RequestStatus]] = []

    def finish_requests(self, req_id: str, status: RequestStatus) -> None:
        self.finished.append((req_id, status))


def _state(tokenizer: Any, params: SamplingParams, prompt_logprobs: Any = None) -> RequestState:
    prompt = list(tokenizer.encode("The capital of France is"))
    request = Request("r", prompt, params)
    return RequestState(request, IncrementalDetokenizer(tokenizer, prompt, params), prompt_logprobs)


def _step(state: RequestState, ids: list[int], finish: FinishReason | None = None) -> Any:
    for t in ids:
        state.request.append_output_token_ids(t)
    return EngineCoreOutput("r", ids, finish_reason=finish)


def test_text_and_length_finish(tokenizer: Any) -> None:
    state = _state(tokenizer, SamplingParams(max_tokens=8))
    sched = _Scheduler()
    ids = list(tokenizer.encode(" Paris, a city", add_special_tokens=False))
    first = process_output(state, _step(state, ids[:1]), sched)  # type: ignore[arg-type]
    rest = process_output(state, _step(state, ids[1:], FinishReason.LENGTH), sched)  # type: ignore[arg-type]
    assert not first.finished and rest.finish_reason == FinishReason.LENGTH
    assert first.new_text + rest.new_text == " Paris, a city"
    assert sched.finished == []  # the scheduler finished it itself


def test_stop_string_finishes_the_request_in_the_scheduler(tokenizer: Any) -> None:
    state = _state(tokenizer, SamplingParams(max_tokens=16, stop=[","]))
    sched = _Scheduler()
    ids = list(tokenizer.encode(" Paris, a city", add_special_tokens=False))
    delta = process_output(state, _step(state, ids), sched)  # type: ignore[arg-type]
    assert delta.finish_reason == FinishReason.STOP and delta.stop_reason == ","
    assert delta.new_text == " Paris"  # the stop string and what follows are cut
    assert sched.finished == [("r", RequestStatus.FINISHED_STOPPED)]


def test_first_delta_carries_the_prompt_logprobs(tokenizer: Any) -> None:
    shared: list[Any] = [None, {1: -0.5}, {2: -0.25}]
    state = _state(tokenizer, SamplingParams(max_tokens=4), shared)
    sched = _Scheduler()
    first = process_output(state, _step(state, [11]), sched)  # type: ignore[arg-type]
    second = process_output(state, _step(state, [12]), sched)  # type: ignore[arg-type]
    assert first.prompt_logprobs == shared and first.prompt_logprobs is not shared
    assert second.prompt_logprobs is None
