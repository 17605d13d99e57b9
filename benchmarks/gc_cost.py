"""What the server's GC settings cost and buy (issue 21, memory): CPython's default
thresholds against ``kvserve serve``'s (``gc.freeze()`` after loading, then
``gc.set_threshold(70_000, 20, 100)``), in one process, rounds interleaved.

    nice -n 19 .venv/bin/python benchmarks/gc_cost.py [--rounds 2]

Builds one ``LLM`` (default model), fills its prefix cache with a warm-up workload
(many long-lived block objects, as a server that has served a while), then runs the
same generation round under each setting in turn (default, server, default,
server...). Per round: wall time, generated tokens/s, collections per generation and
the time the collector ran (``gc.callbacks``), and the RSS after the round. Timings
on a shared machine are noisy: compare the interleaved rounds of one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from typing import Any

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.serve_cmd import GC_GEN0_THRESHOLD

DEFAULT = (700, 10, 10)
SERVER = (GC_GEN0_THRESHOLD, 20, 100)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return -1.0


class GcTimer:
    """Counts collections per generation and their total pause (gc.callbacks)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.pause_s = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pause_s += time.perf_counter() - self._t0
            self.counts[info["generation"]] += 1


def configure(setting: str) -> None:
    gc.collect()
    if setting == "server":
        gc.freeze()
        gc.set_threshold(*SERVER)
    else:
        gc.unfreeze()
        gc.set_threshold(*DEFAULT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds per setting")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup-prompts", type=int, default=256)
    args = parser.parse_args()
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(n)]

    llm = LLM(max_num_seqs=32, max_model_len=2048, num_kv_blocks=4096)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(
        prompt_token_ids=prompts(args.warmup_prompts), sampling_params=warm, use_tqdm=False
    )
    # A full collection over the loaded engine's heap, as the default thresholds run
    # (default thresholds: one per 100 young ones; the server's: one per 2,000).
    for frozen in (False, True):
        configure("server" if frozen else "default")
        t0 = time.perf_counter()
        gc.collect()
        print(
            json.dumps(
                {
                    "full_collection_ms": round((time.perf_counter() - t0) * 1000, 1),
                    "frozen": frozen,
                    "tracked_objects": len(gc.get_objects()),
                    "frozen_objects": gc.get_freeze_count(),
                }
            ),
            flush=True,
        )
    timer = GcTimer()
    gc.callbacks.append(timer)
    rows = []
    for r in range(2 * args.rounds):
        setting = ("default", "server")[r % 2]
        configure(setting)
        batch = prompts(args.num_prompts)
        timer.counts, timer.pause_s = [0, 0, 0], 0.0
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {
            "round": r,
            "setting": setting,
            "wall_s": round(wall, 2),
            "tok_per_s": round(tokens / wall, 1),
            "collections_gen0_1_2": list(timer.counts),
            "gc_pause_ms": round(timer.pause_s * 1000, 1),
            "gc_share": round(timer.pause_s / wall, 4),
            "rss_mb": round(rss_mb(), 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    gc.callbacks.remove(timer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
