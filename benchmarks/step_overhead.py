"""Per-step costs besides the forward pass, at N running decodes (issue 10 item 4).

Runs a real engine (``EngineCore`` on the default model) with ``--num-requests``
requests of ``--prompt-len`` random tokens decoding together, and splits each
engine step into: scheduling (``scheduler.schedule``), runner state update and input
preparation (``InputBatch.update_states`` + ``prepare_inputs``, attention metadata
included), the model forward, logits, sampling, the scheduler's update from the
output, and detokenization. Prints ms per step (medians over ``--steps`` decode
steps) and each part's share of the step. A benchmark, not a test.

    .venv/bin/python benchmarks/step_overhead.py [--num-requests 64] [--steps 30]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from typing import Any

from kvserve.bench.timing import ENGINE_STEP_PARTS, time_engine_step
from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.request import SamplingParams

PARTS = ENGINE_STEP_PARTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--temperature", type=float, default=0.8, help="0 = greedy (default: %(default)s)"
    )
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()

    config = EngineConfig(
        model=ModelConfig(dtype=args.dtype),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(
            max_num_seqs=max(args.num_requests, 1),
            max_num_batched_tokens=max(2048, args.prompt_len),
            max_model_len=2048,
        ),
    )
    engine = EngineCore(config)
    acc: dict[str, float] = defaultdict(float)
    runner: Any = engine.runner  # the ModelRunner (the engine types it by its protocol)
    time_engine_step(engine, acc)

    rng = random.Random(0)
    params = SamplingParams(
        max_tokens=args.steps + 50, temperature=args.temperature, top_p=args.top_p, seed=1
    )
    for _ in range(args.num_requests):
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
        engine.add_request(prompt, params)
    # prefill everything: until one step gives every request a token (a decode step)
    for _ in range(10_000):
        if sum(1 for d in engine.step() if d.new_token_ids) == args.num_requests:
            break
    for _ in range(2):
        engine.step()
    per_step: dict[str, list[float]] = defaultdict(list)
    totals = []
    for _ in range(args.steps):
        acc.clear()
        t0 = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - t0)
        for p in PARTS:
            per_step[p].append(acc.get(p, 0.0))
    total = statistics.median(totals)
    dtype = str(getattr(engine.loaded, "dtype", "?")).removeprefix("torch.")
    print(
        f"{args.num_requests} running decodes, prompt {args.prompt_len}, dtype={dtype}, "
        f"temperature={args.temperature}, top_p={args.top_p}, "
        f"attention={runner.attention_backend}: step {total * 1e3:.1f} ms (median of {args.steps})"
    )
    overhead = 0.0
    for p in PARTS:
        ms = statistics.median(per_step[p]) * 1e3
        if p not in ("forward", "logits"):
            overhead += ms
        print(f"  {p:<20}{ms:8.2f} ms {ms / (total * 1e3):6.1%}")
    rest = total * 1e3 - sum(statistics.median(per_step[p]) * 1e3 for p in PARTS)
    print(f"  {'other (engine loop)':<20}{rest:8.2f} ms {rest / (total * 1e3):6.1%}")
    overhead += max(rest, 0.0)
    print(f"everything but forward and logits: {overhead:.2f} ms = {overhead / (total * 1e3):.1%}")


if __name__ == "__main__":
    main()
