"""Step cost of verifying draft tokens: one decode step of B requests with 0..k drafts
each, on the real model runner (the cost model of kvserve.spec_decode.controller).

    PYTHONPATH=. python benchmarks/spec_step_cost.py --dtype bfloat16 --batches 1,4,16 --k 0,1,2,4

Prints the median step time per (batch, drafts) and rho = (T(B, k) / T(B, 0) - 1) / (B * k)
relative to T(1, 0), the fitted per-token cost as a fraction of a one-token step.
Steps of one configuration are interleaved with the others (noisy shared machines).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.model.loader import load_model
from kvserve.request import SamplingParams
from kvserve.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from kvserve.speculative_config import SpeculativeConfig
from kvserve.worker.model_runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--k", default="0,1,2,4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    ks = [int(x) for x in args.k.split(",")]
    loaded = load_model(dtype=args.dtype)
    bs = 16
    ctx = args.context
    per_req = ctx // bs + 2
    nb = max(batches)
    cache = CacheConfig(block_size=bs, num_kv_blocks=1 + nb * per_req)
    sched = SchedulerConfig(max_num_batched_tokens=8192)
    spec = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": max(ks) or 1})
    runner = ModelRunner(loaded, cache, sched, speculative_config=spec)
    greedy = SamplingParams(temperature=0.0, max_tokens=4096)
    ids = [f"r{i}" for i in range(nb)]
    blocks = {r: list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for i, r in enumerate(ids)}
    prompt = [int(t) for t in torch.randint(100, 40000, (ctx,))]
    # prefill every request once (KV for the context), one at a time
    for r in ids:
        so = SchedulerOutput(
            phase="prefill",
            scheduled_new_reqs=[NewRequestData(r, prompt, [], blocks[r], 0, greedy)],
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={r: ctx},
            num_scheduled_tokens_padded={r: ctx},
            scheduled_token_ids={r: prompt},
            cached_seq_len={r: 0},
        )
        runner.execute_model(so)

    def step(b: int, k: int) -> float:
        sel = ids[:b]
        drafts = {r: [7] * k for r in sel} if k else {}
        so = SchedulerOutput(
            phase="decode",
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(sel, [[] for _ in sel], [ctx] * b),
            num_scheduled_tokens={r: 1 + k for r in sel},
            num_scheduled_tokens_padded={r: 1 + k for r in sel},
            scheduled_token_ids={r: [5] + [7] * k for r in sel},
            cached_seq_len={r: ctx for r in sel},
            scheduled_spec_decode_tokens=drafts,
        )
        for r in sel:  # keep the runner's view: ctx + 1 tokens, nothing generated past
            st = runner.input_batch.requests[r]
            del st.sampling.output_token_ids[:]
            st.sampling.output_token_ids.append(5)
            st.block_ids[:] = blocks[r]
        t = time.perf_counter()
        runner.execute_model(so)
        return time.perf_counter() - t

    times: dict[tuple[int, int], list[float]] = {(b, k): [] for b in batches for k in ks}
    for _ in range(2):
        for key in times:
            step(*key)
    for _ in range(args.reps):
        for key in times:
            times[key].append(step(*key))
    med = {key: statistics.median(v) * 1000 for key, v in times.items()}
    base = med[(1, 0)] if (1, 0) in med else min(med.values())
    print(f"dtype={args.dtype} context={ctx} threads={args.threads}; T(1,0)={base:.1f} ms")
    for b in batches:
        row = "  ".join(f"k={k}: {med[(b, k)]:7.1f} ms" for k in ks)
        rhos = [(med[(b, k)] - med[(b, 0)]) / (b * k) / base for k in ks if k and (b, 0) in med]
        print(
            f"B={b:3d}  {row}   rho(per extra token / T(1,0)) = "
            + ", ".join(f"{x:.3f}" for x in rhos)
        )


if __name__ == "__main__":
    main()
