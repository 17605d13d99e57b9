"""Ceiling of n-gram speculation on a copy workload, by replay: the target's greedy
outputs of spec-edit prompts (generated once, offline, one thread) are fed through the
proposer and the controller step by step, with a step cost of ``BASE + ROW * drafts``
(measured with ``benchmarks/spec_step_profile.py``), to give the decode-phase speed-up
each setting can reach without running the model again. ``--oracle`` adds the best
match in hindsight (every n-gram match tried, the longest acceptance kept).

    PYTHONPATH=. python benchmarks/spec_ngram_replay.py --num-requests 12 --ks 4,8,12
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch

from kvserve.bench.spec_workloads import build_spec_sessions, first_turn_prompts
from kvserve.spec_decode.controller import SpecController
from kvserve.spec_decode.decoder import History
from kvserve.spec_decode.ngram import NgramProposer


def generate(num: int, max_tokens: int) -> list[dict[str, list[int]]]:
    from kvserve.engine.args import build_engine_config
    from kvserve.engine.engine_core import EngineCore
    from kvserve.model.loader import load_model
    from kvserve.request import SamplingParams

    torch.set_num_threads(1)
    loaded = load_model(dtype="bfloat16", quantization="auto")
    tok = loaded.tokenizer
    eng = EngineCore(
        build_engine_config(dtype="bfloat16", quantization="auto", max_model_len=2048),
        loaded=loaded,
    )
    sessions = build_spec_sessions("spec-edit", num, 200, max_tokens, 1, random.Random(0))
    prompts = first_turn_prompts(tok, sessions)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=str(i))
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for d in eng.step():
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)
    return [{"prompt": p, "out": outs[str(i)]} for i, p in enumerate(prompts)]


def replay(data: list[dict[str, list[int]]], k: int, lo: int, hi: int, base: float, row: float):
    ctl = SpecController(k, step_cost_per_token=0.15)
    prop = NgramProposer(lo, hi)
    cost = steps = tokens = 0.0
    for ri, r in enumerate(data):
        prompt, out, rid = r["prompt"], r["out"], str(ri)
        i = 1  # the first token comes from the prefill
        while i < len(out):
            want = ctl.plan([rid])[0]
            d = prop.propose([rid], [History(prompt, out[:i])], [want])[0]
            d = d[: max(0, len(out) - i - 1)]
            m = 0
            while m < len(d) and d[m] == out[i + m]:
                m += 1
            ctl.observe(rid, len(d), m)
            cost += base + row * len(d)
            steps += 1
            tokens += m + 1
            i += m + 1
        ctl.drop(rid)
        prop.drop(rid)
    plain = sum(len(r["out"]) - 1 for r in data) * base
    return plain / cost, tokens / steps


def oracle(data: list[dict[str, list[int]]], k: int, hi: int, base: float, row: float) -> float:
    cost = 0.0
    for r in data:
        out = r["out"]
        hist = np.array(r["prompt"] + out, dtype=np.int64)
        n0 = len(r["prompt"])
        i = 1
        while i < len(out):
            t = hist[: n0 + i]
            best = 0
            for n in range(1, min(hi, len(t) - 1) + 1):
                for e in np.flatnonzero(
                    (np.lib.stride_tricks.sliding_window_view(t[:-1], n) == t[-n:]).all(1)
                ):
                    d = t[e + n : e + n + k]
                    m = 0
                    while m < len(d) and i + m < len(out) and d[m] == out[i + m]:
                        m += 1
                    best = max(best, m)
            cost += base + row * k
            i += best + 1
    return sum(len(r["out"]) - 1 for r in data) * base / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", default="4,8,12")
    ap.add_argument("--lookup-max", default="4,8")
    ap.add_argument("--base-ms", type=float, default=7.5, help="a plain decode step")
    ap.add_argument("--row-ms", type=float, default=0.58, help="one more row in a step")
    ap.add_argument("--cache", default="", help="JSON file of generated outputs (reused)")
    ap.add_argument("--oracle", action="store_true")
    a = ap.parse_args()
    path = Path(a.cache) if a.cache else None
    if path is not None and path.exists():
        data = json.loads(path.read_text())
    else:
        data = generate(a.num_requests, a.max_tokens)
        if path is not None:
            path.write_text(json.dumps(data))
    for hi in (int(x) for x in a.lookup_max.split(",")):
        for k in (int(x) for x in a.ks.split(",")):
            speedup, per_step = replay(data, k, 1, hi, a.base_ms, a.row_ms)
            line = f"k={k} prompt_lookup_max={hi}: decode speed-up {speedup:.3f}x"
            line += f", {per_step:.2f} tokens/step"
            if a.oracle:
                line += f", best match in hindsight {oracle(data, k, hi, a.base_ms, a.row_ms):.3f}x"
            print(line)


if __name__ == "__main__":
    main()
