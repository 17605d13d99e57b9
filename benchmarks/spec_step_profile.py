"""Where a single stream's time goes with and without n-gram speculation: thread CPU
time (``time.thread_time``, one torch thread, so a loaded shared machine's
descheduling does not count) per phase of the runner, spec-edit prompts one at a
time, base and spec engines interleaved request by request.

    PYTHONPATH=. python benchmarks/spec_step_profile.py --num-requests 6 --k 4

Prints per request the CPU seconds, the CPU time to the first token and the steps of
each engine, the whole-request and decode-phase ratios, whether the outputs are
identical (greedy), and per phase the total, calls and milliseconds per call
(``fwd.1``: one-row decode forwards; ``fwd.<=17``: verification chunks; ``logits.*``:
the LM head).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from kvserve.bench.spec_workloads import build_spec_sessions, first_turn_prompts
from kvserve.bench.timing import wrap_attr
from kvserve.engine.args import build_engine_config
from kvserve.engine.engine_core import EngineCore
from kvserve.model.loader import load_model
from kvserve.request import SamplingParams

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)
clock = time.thread_time


def wrap(obj: Any, name: str, label: str) -> None:
    wrap_attr(obj, name, TIMES, label, clock=clock, counts=COUNTS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec", default=None, help="a speculative config (JSON); default ngram k")
    a = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(dtype="bfloat16", quantization="auto")
    tok = loaded.tokenizer
    spec = json.loads(a.spec) if a.spec else {
        "method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4,
    }  # fmt: skip
    common: dict[str, Any] = dict(dtype="bfloat16", quantization="auto", max_model_len=2048)
    engines = {
        "base": EngineCore(build_engine_config(**common), loaded=loaded),
        "spec": EngineCore(build_engine_config(speculative_config=spec, **common), loaded=loaded),
    }
    for mode, eng in engines.items():
        r: Any = eng.runner
        wrap(r, "_sample", f"{mode}.sample")
        wrap(eng.scheduler, "schedule", f"{mode}.schedule")
        wrap(eng.scheduler, "update_from_output", f"{mode}.update")
        if mode == "spec":
            wrap(r, "_sample_verify", "spec.sample_verify")
            wrap(r, "_propose", "spec.propose")
    base_runner: Any = engines["base"].runner  # the ModelRunner
    model = base_runner.model
    forward, logits = model.forward, model.compute_logits

    def timed_forward(*args: Any, **kw: Any) -> Any:
        t0 = clock()
        try:
            return forward(*args, **kw)
        finally:
            n = args[0].shape[0]
            label = "fwd.1" if n == 1 else ("fwd.<=17" if n <= 17 else "fwd.prefill")
            TIMES[label] += clock() - t0
            COUNTS[label] += 1

    def timed_logits(h: torch.Tensor) -> torch.Tensor:
        t0 = clock()
        try:
            return logits(h)
        finally:
            label = "logits.1" if h.shape[0] == 1 else "logits.n"
            TIMES[label] += clock() - t0
            COUNTS[label] += 1

    model.forward = timed_forward  # type: ignore[method-assign]
    model.compute_logits = timed_logits  # type: ignore[method-assign]
    sessions = build_spec_sessions(
        "spec-edit", a.num_requests, 200, a.max_tokens, 1, random.Random(0)
    )
    prompts = first_turn_prompts(tok, sessions)
    res: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    same = []
    for i, p in enumerate(prompts):
        outs = {}
        for mode in ("base", "spec") if i % 2 == 0 else ("spec", "base"):
            eng = engines[mode]
            params = SamplingParams(
                temperature=a.temperature, max_tokens=a.max_tokens, ignore_eos=True, seed=7
            )
            t0 = clock()
            eng.add_request(p, params, request_id=f"{mode}{i}")
            first, steps, toks = None, 0, []
            while eng.has_unfinished_requests():
                steps += 1
                for d in eng.step():
                    if d.new_token_ids and first is None:
                        first = clock() - t0
                    toks += d.new_token_ids
            eng.check_no_leaks()
            res[mode].append((clock() - t0, first or 0.0, steps))
            outs[mode] = toks
        same.append(outs["base"] == outs["spec"])
    for mode in ("base", "spec"):
        r = res[mode]
        print(
            f"{mode}: cpu s/request {[round(x[0], 3) for x in r]}, to first token "
            f"{[round(x[1], 3) for x in r]}, steps {[x[2] for x in r]}"
        )
    whole = [b[0] / s[0] for b, s in zip(res["base"], res["spec"], strict=True)]
    dec = [(b[0] - b[1]) / (s[0] - s[1]) for b, s in zip(res["base"], res["spec"], strict=True)]
    print(
        f"whole-request ratio {[round(x, 3) for x in whole]}, median {statistics.median(whole):.3f}"
    )
    print(f"decode-phase ratio {[round(x, 3) for x in dec]}, median {statistics.median(dec):.3f}")
    print(f"identical outputs: {same}")
    for k in sorted(TIMES):
        print(
            f"{k:20s} {TIMES[k]:8.3f} s {COUNTS[k]:6d} calls {1e3 * TIMES[k] / COUNTS[k]:8.3f} ms/call"
        )
    print(engines["spec"].scheduler.spec_stats.snapshot())


if __name__ == "__main__":
    main()
