"""One decode stream, one step at a time: where a batch-1 decode step's time goes.

Runs a real engine (``EngineCore``, default model and options) on one request of
``--prompt-len`` random tokens, greedy, and times each decode step's parts:
scheduling, runner input preparation, the model forward (embedding + layers), logits
(final norm + lm_head), sampling, the scheduler's update, detokenization and the rest
of the engine step. With ``--ab`` the fused decode step (``KVSERVE_FUSED_DECODE``) is
switched off and on at alternate steps of the same request, so both halves see the
same load; the report is medians per variant. ``--clock cpu`` uses this thread's CPU
time (meaningful with ``--threads 1`` on a loaded machine), ``wall`` the wall clock.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_profile.py --threads 1 --clock cpu --ab
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from kvserve.bench.timing import ENGINE_STEP_PARTS, time_engine_step

PARTS = tuple(p for p in ENGINE_STEP_PARTS if p != "update_states")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="wall")
    ap.add_argument("--ab", action="store_true", help="alternate fused decode off/on")
    ap.add_argument(
        "--quantization", default="auto", help="the engine's weights (none: float weights)"
    )
    ap.add_argument("--model", default=None, help="model name, GGUF file or folder")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvserve.config import EngineConfig, ModelConfig
    from kvserve.engine.engine_core import EngineCore
    from kvserve.request import SamplingParams

    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    model_cfg = ModelConfig(quantization=args.quantization)
    if args.model:
        model_cfg = ModelConfig(model=args.model, quantization=args.quantization)
    engine = EngineCore(EngineConfig(model=model_cfg))
    acc: dict[str, float] = defaultdict(float)

    runner: Any = engine.runner  # the ModelRunner (the engine types it by its protocol)
    model = runner.model
    time_engine_step(engine, acc, clock=clock, parts=PARTS)

    fused = model._fused_decode
    variants = ["fused", "loop"] if args.ab and fused is not None else ["default"]
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params)
    for _ in range(1000):  # prefill until the first token
        if any(d.new_token_ids for d in engine.step()):
            break
    engine.step()
    per: dict[str, dict[str, list[float]]] = {v: defaultdict(list) for v in variants}
    for i in range(args.steps):
        v = variants[i % len(variants)]
        if v != "default":
            model._fused_decode = fused if v == "fused" else None
        acc.clear()
        t0 = clock()
        engine.step()
        total = clock() - t0
        per[v]["step"].append(total)
        for p in PARTS:
            per[v][p].append(acc.get(p, 0.0))
        per[v]["other"].append(total - sum(acc.get(p, 0.0) for p in PARTS))
    model._fused_decode = fused
    print(
        f"one stream, prompt {args.prompt_len}, {args.steps} decode steps, threads "
        f"{torch.get_num_threads()}, clock {args.clock}, weights {model.weight_formats()}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'ms (median)':<20}" + "".join(f"{v:>10}" for v in variants))
    for p in ("step", *PARTS, "other"):
        row = [statistics.median(per[v][p]) * 1e3 for v in variants]
        print(f"{p:<20}" + "".join(f"{x:10.3f}" for x in row))
    if len(variants) == 2:
        a, b = (statistics.median(per[v]["step"]) for v in variants)
        print(f"step ratio fused/loop: {a / b:.3f}")


if __name__ == "__main__":
    main()
