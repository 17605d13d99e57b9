"""``step_trace``: one JSON line per executed step under ``max_step_ms``."""

from __future__ import annotations

import json
from pathlib import Path

from kvserve import LLM, SamplingParams


def test_step_trace_writes_one_line_per_step(tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    llm = LLM(max_num_seqs=4, num_kv_blocks=64, step_trace=str(trace))
    assert llm.engine.scheduler.cost_model is not None  # the default max_step_ms is on
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    # the first step holds both prompts whole; three decode steps of two rows follow
    assert len(lines) == 4
    assert sorted(lines[0]["rows"]) == [[15, 0], [32, 0]]
    assert all(sorted(r[0] for r in x["rows"]) == [1, 1] for x in lines[1:])
    assert sorted(r[1] for r in lines[-1]["rows"]) == [17, 34]  # contexts of the last decodes
    for x in lines:
        assert x["measured_ms"] > 0 and x["predicted_ms"] > 0
        assert x["scale"] > 0 and x["prompt_scale"] > 0
    llm.engine.check_no_leaks()
    # an unwritable path never fails a step
    bad = LLM(max_num_seqs=2, num_kv_blocks=32, step_trace=str(tmp_path / "no" / "dir" / "f"))
    out = bad.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
