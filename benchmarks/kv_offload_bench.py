"""TTFT of a long prompt whose KV blocks are on disk after a restart, against a cold
compute (issue 40's target: <= 0.3x).

Every phase runs in its own process (a real restart: nothing survives in RAM)::

    cold     an engine without the disk tier: TTFT of the prompt, computed
    write    an engine with --kv-offload-dir on an empty directory: computes the
             prompt (its blocks are written through), closes (queued writes land)
    restart  a new engine on the same directory: TTFT of the same prompt, its full
             blocks loaded from disk (the tier's hit and read counters are printed)

TTFT here is the wall time of ``LLM.generate`` with ``max_tokens=1``, after one short
warm-up request in the same process (so start-up costs are not counted). The files
are likely in the OS page cache in the restart phase (this script cannot drop it
without root); a cold disk adds its read time (bytes_read is printed).

    python benchmarks/kv_offload_bench.py                      # 3k tokens, 3 repeats
    python benchmarks/kv_offload_bench.py --prompt-tokens 256 --repeats 1   # a quick check
    python benchmarks/kv_offload_bench.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


def run_phase(args: argparse.Namespace) -> dict[str, Any]:
    """One engine in this process: warm up, time the prompt, report."""
    from kvserve import LLM, SamplingParams

    opts: dict[str, Any] = {"max_model_len": args.prompt_tokens + 64}
    if args.model:
        opts["model"] = args.model
    if args.phase != "cold":
        opts["kv_offload_dir"] = args.dir
    llm = LLM(**opts)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(prompt_token_ids=[_prompt(64, 999)], sampling_params=one, use_tqdm=False)
    prompt = _prompt(args.prompt_tokens, args.seed)
    t0 = time.perf_counter()
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=one, use_tqdm=False)
    ttft = time.perf_counter() - t0
    stats = llm.engine.stats()
    llm.engine.close()
    return {
        "phase": args.phase,
        "ttft_s": ttft,
        "first_token": out[0].outputs[0].token_ids[0],
        "prefix_cache_hits": stats.prefix_cache_hits,
        "kv_offload_hits": stats.kv_offload_hits,
        "kv_offload_bytes_read": stats.kv_offload_bytes_read,
        "kv_offload_bytes_written": stats.kv_offload_bytes_written,
        "kv_offload_read_seconds": stats.kv_offload_read_seconds,
        "kv_offload_errors": stats.kv_offload_errors,
    }


def _child(args: argparse.Namespace, phase: str, directory: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--phase",
        phase,
        "--dir",
        directory,
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--seed",
        str(args.seed),
    ]
    if args.model:
        cmd += ["--model", args.model]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=3, help="cold/restart pairs (median reported)")
    p.add_argument("--model", default=None, help="default: the engine's default model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--phase", choices=("cold", "write", "restart"), help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args)))
        return
    rows: list[dict[str, Any]] = []
    for i in range(args.repeats):
        directory = tempfile.mkdtemp(prefix="kv_offload_bench_")
        try:
            cold = _child(args, "cold", directory)
            write = _child(args, "write", directory)
            restart = _child(args, "restart", directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        same = cold["first_token"] == restart["first_token"] == write["first_token"]
        rows += [cold, write, restart]
        print(
            f"run {i}: cold {cold['ttft_s'] * 1e3:.0f} ms, with tier (writing) "
            f"{write['ttft_s'] * 1e3:.0f} ms, after restart {restart['ttft_s'] * 1e3:.0f} ms "
            f"({restart['ttft_s'] / cold['ttft_s']:.3f}x cold; {restart['kv_offload_hits']} blocks, "
            f"{restart['kv_offload_bytes_read'] / 1e6:.1f} MB read in "
            f"{restart['kv_offload_read_seconds'] * 1e3:.0f} ms; same first token: {same})"
        )
    cold_s = statistics.median(r["ttft_s"] for r in rows if r["phase"] == "cold")
    restart_s = statistics.median(r["ttft_s"] for r in rows if r["phase"] == "restart")
    ratio = restart_s / cold_s
    print(
        f"{args.prompt_tokens}-token prompt: median TTFT cold {cold_s * 1e3:.0f} ms, after a "
        f"restart from disk {restart_s * 1e3:.0f} ms = {ratio:.3f}x (target <= 0.3x: "
        f"{'met' if ratio <= 0.3 else 'NOT met'})"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {"prompt_tokens": args.prompt_tokens, "ratio": ratio, "rows": rows}, fh, indent=1
            )


if __name__ == "__main__":
    main()
