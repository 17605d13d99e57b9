"""Step-budget rules on a virtual clock: the real engine and scheduler (kvserve's
EngineCore on the simulator's stand-in runner), every step lasting what a fixed cost
model says (default: the fit kvserve logged at startup on a quiet 2-core Zen 5, bf16,
in the peer run of 2026-12-01), requests sent like vLLM's bench client (Poisson at
``--request-rate``, at most ``--max-concurrency`` in flight). Prints the streams'
figures (tok/s, mean TTFT, mean TPOT, p50/p99 ITL) per configuration.

What this is for: on a shared, overloaded machine a real run's step times vary 2-10x
from one step to the next; the schedule a rule produces (which prompts go into which
step) and what it costs at the quiet machine's speed can still be compared here,
deterministically. It is a model: it leaves out HTTP/detokenizer time and the real
steps' noise, so use it to choose between rules, then check on a quiet machine.

    PYTHONPATH=. python benchmarks/step_budget_vsim.py --workload shared-prefix \
        --variant "300=--max-step-ms 300" --variant "120=--max-step-ms 120"
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
from typing import Any

from kvserve.bench.step_cost_report import RequestTimes, stream_figures
from kvserve.bench.workloads import arrival_times
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.request import SamplingParams
from kvserve.sched.cost_model import (
    CostModel,
    output_rows,
    prompt_features,
    step_features,
)
from kvserve.sim.runner import UNBOUNDED_VOCAB, SimulatedModel, StandInRunner

# kvserve serve's startup fit in the quiet peer run (bf16, default 4-bit weights):
# ms/step, ms/token, ms/prefill pair, ms/decode ctx token, ms/sampled row.
QUIET_BF16 = (7.08, 0.5847, 2.2038e-4, 9.982e-4, 0.0495)


def prompts_for(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    if args.workload == "random":
        return [
            (ids(args.input_len or 512), args.output_len or 128) for _ in range(args.num_requests)
        ]
    if args.workload == "shared-prefix":
        per = args.num_requests // args.num_prefixes
        out = []
        for _ in range(args.num_prefixes):
            prefix = ids(args.prefix_len)
            out += [(prefix + ids(args.input_len or 64), args.output_len or 64) for _ in range(per)]
        rng.shuffle(out)
        return out
    # a JSONL file of {"prompt", "output_tokens"}: about 1.3 tokens per word (the
    # peer workloads' words are single common English words, some split in two)
    with open(args.workload) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    words: dict[str, int] = {}
    out = []
    for r in rows:
        toks = []
        for w in r["prompt"].split():
            toks.append(words.setdefault(w, 100 + len(words)))
        out.append((toks, int(r["output_tokens"])))
    if not args.no_shuffle:
        random.Random(args.seed).shuffle(out)
    return out


def run(
    config: SchedulerConfig, prompts: list[tuple[list[int], int]], args: argparse.Namespace
) -> dict[str, Any]:
    config = config.resolved()
    block_size = CacheConfig().block_size
    num_blocks = 1 + (args.kv_tokens // block_size)
    runner = StandInRunner(num_blocks)
    runner.cost_model = CostModel(tuple(args.coef), source="model", online=False)  # type: ignore[arg-type]
    now = [0.0]
    engine = EngineCore(
        EngineConfig(
            cache=CacheConfig(
                block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=True
            ),
            scheduler=config,
        ),
        loaded=SimulatedModel(config.model_len, vocab_size=UNBOUNDED_VOCAB),
        runner=runner,
        clock=lambda: now[0],
    )
    runner.engine = engine
    # --sched-coef: the scheduler plans with another fit (a start's) than the clock's,
    # corrected online from the virtual step times as the engine corrects its own
    observed: list[Any] = []
    sched_model: CostModel | None = None
    if args.sched_coef:
        sched_model = CostModel(tuple(args.sched_coef), source="start")  # type: ignore[arg-type]
        sched_model.calibration = list(args.sched_calibration or [])
        engine.scheduler.cost_model = sched_model
        engine._observe_step = lambda model, so, out, t0: observed.append((so, out))  # type: ignore[method-assign]
    noise = random.Random(args.seed + 1)
    arrivals = arrival_times(len(prompts), args.request_rate, seed=args.seed)
    limit = args.max_concurrency or len(prompts)
    times: dict[str, RequestTimes] = {}
    in_flight: set[str] = set()
    steps: list[dict[str, Any]] = []
    added = 0
    while added < len(prompts) or engine.has_unfinished_requests():
        while added < len(prompts) and arrivals[added] <= now[0] and len(in_flight) < limit:
            p, n = prompts[added]
            req = engine.make_request(list(p), SamplingParams(max_tokens=n, temperature=0.0))
            runner.requests[req.req_id] = req
            engine.add(req)
            times[req.req_id] = RequestTimes(added=now[0])
            in_flight.add(req.req_id)
            added += 1
        if not engine.has_unfinished_requests():
            now[0] = max(now[0], arrivals[added])
            continue
        runner.record = None
        deltas = engine.step()
        rec = runner.record
        if rec is not None:
            ms = rec["predicted_ms"]
            if args.noise:
                ms *= noise.lognormvariate(0.0, args.noise)
            now[0] += ms / 1e3 + args.client_ms / 1e3
            rec["ms"] = ms
            steps.append(rec)
            if sched_model is not None and observed:
                so, out_ = observed.pop()
                rows = output_rows(
                    so.num_scheduled_tokens,
                    so.cached_seq_len,
                    out_.sampled_token_ids,
                    so.num_scheduled_tokens_padded,
                    so.decode_batch_size_padded,
                )
                sched_model.observe(step_features(rows), ms + args.client_ms, prompt_features(rows))
        observed.clear()
        for d in deltas:
            rt = times.get(d.request_id)
            if rt is None:
                continue
            if d.new_token_ids:
                rt.tokens.append(now[0])
                rt.num_tokens += len(d.new_token_ids)
            if d.finish_reason is not None:
                in_flight.discard(d.request_id)
        if len(steps) > 200_000:
            raise RuntimeError("too many steps")
    out: dict[str, Any] = dict(stream_figures(list(times.values()), now[0]))
    with_dec = [s["ms"] for s in steps if any(n == 1 for n in s["num_scheduled_tokens"].values())]
    out["steps"] = len(steps)
    total = sum(len(p) for p, _ in prompts)
    computed = sum(n for st in steps for n in st["num_scheduled_tokens"].values() if n > 1)
    out["prompt_tokens_computed_pct"] = 100.0 * computed / total
    out["p99_step_with_decodes_ms"] = (
        sorted(with_dec)[int(0.99 * len(with_dec))] if with_dec else 0.0
    )
    out["_steps"] = steps
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--workload", default="shared-prefix", help="random, shared-prefix or a JSONL path"
    )
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--num-prefixes", type=int, default=2)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--no-shuffle", action="store_true", help="JSONL: send in file order")
    ap.add_argument("--seeds", type=int, default=1, help="median over this many seeds")
    ap.add_argument("--coef", type=float, nargs=5, default=list(QUIET_BF16))
    ap.add_argument(
        "--sched-coef",
        type=float,
        nargs=5,
        default=None,
        help="the scheduler's model (a start's fit, corrected online on the virtual clock); "
        "default: the clock's own, fixed",
    )
    ap.add_argument("--noise", type=float, default=0.0, help="lognormal sigma of step times")
    ap.add_argument("--client-ms", type=float, default=1.0, help="per-step host overhead added")
    ap.add_argument("--kv-tokens", type=int, default=200_000)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SCHEDULER FLAGS")
    ap.add_argument("--trace", default=None, help="print the steps with decodes of this variant")
    ap.add_argument(
        "--sched-fit",
        default=None,
        help='JSON {"coef": [5 floats], "calibration": [[features, ms], ...]} (a stored '
        "fit's file, ~/.cache/kvserve/step_cost/*.json): --sched-coef with its "
        "calibration samples, which the online refits keep",
    )
    args = ap.parse_args()
    args.sched_calibration = None
    if args.sched_fit:
        with open(args.sched_fit) as f:
            fit = json.load(f)
        args.sched_coef = [float(c) for c in fit["coef"]]
        args.sched_calibration = [(tuple(x), float(ms)) for x, ms in fit.get("calibration", [])]
    keys = (
        "output_tok_s",
        "mean_ttft_ms",
        "mean_tpot_ms",
        "p50_itl_ms",
        "p99_itl_ms",
        "p99_step_with_decodes_ms",
        "prompt_tokens_computed_pct",
    )
    print(f"{'variant':<16}" + "".join(f"{k[:13]:>14}" for k in keys))
    base_seed = args.seed
    for spec in args.variant or ["default="]:
        name, _, flags = spec.partition("=")
        kw: dict[str, Any] = {"max_model_len": 8192}
        toks = shlex.split(flags)
        for i in range(0, len(toks), 2):
            key = toks[i].lstrip("-").replace("-", "_")
            val: Any = toks[i + 1]
            kw[key] = float(val) if "." in val or key == "max_step_ms" else int(val)
        results = []
        for s in range(args.seeds):
            args.seed = base_seed + s
            res = run(SchedulerConfig(**kw), prompts_for(args), args)
            results.append(res)
        args.seed = base_seed
        med = {k: statistics.median(r[k] for r in results) for k in keys}
        print(f"{name:<16}" + "".join(f"{med[k]:>14.1f}" for k in keys))
        if args.trace == name:
            for st in results[0]["_steps"]:
                rows = st["num_scheduled_tokens"]
                ctx = st.get("num_computed_tokens", {})
                dec = [r for r, n in rows.items() if n == 1]
                chunks = [f"{n}@{ctx.get(r, '?')}" for r, n in rows.items() if n > 1]
                print(
                    f"   {st['ms']:7.1f} ms  {len(dec):2d} dec | {' '.join(chunks)}",
                    file=sys.stderr,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
