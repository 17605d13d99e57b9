"""Engine-level batch-invariance check (docs/determinism.md).

The same requests through ``LLM`` in several ways must give bitwise-identical tokens
and logprobs:

- ``alone``: each request by itself, its own cache salt (nothing cached, nothing shared);
- ``batched``: all of them in groups of 1..``max_num_seqs`` mixed requests (prompts that
  share a prefix share blocks and in-flight computation within a group);
- ``cache_hit``: the same groups again, so every prompt but its last block comes from
  the prefix cache;
- ``preempted`` (optional): all at once on a KV cache too small for them, so the
  scheduler preempts and recomputes.

Greedy requests ask for logprobs; seeded sampled requests (temperature, top-p) check
that a draw depends only on the seed and the position. :func:`check_invariance`
returns the counts per mode and the mismatches among the requests the engine's mode
guarantees (every request in the full mode; in the automatic default, those whose
prompt + ``max_tokens`` fit its reach); requests past the reach are counted apart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvserve.bench.invariance_disagg import check_disaggregated
from kvserve.request import SamplingParams

__all__ = ["InvarianceReport", "check_disaggregated", "check_invariance", "make_prompts", "run"]


@dataclass
class InvarianceReport:
    dtype: str
    batch_invariant: bool
    num_prompts: int
    prompt_lens: list[int]
    modes: list[str]
    mismatches: list[str] = field(default_factory=list)
    # the automatic mode's reach (0: off; the full mode covers every length)
    invariant_max_context: int = 0
    weights: str = ""
    # mode -> [requests identical to alone, requests compared], split by whether the
    # request (prompt + max_tokens) is within the guarantee (the full mode, or the
    # automatic mode's reach) or past it
    counts: dict[str, dict[str, list[int]]] = field(default_factory=dict)


def make_prompts(
    num: int, min_len: int, max_len: int, seed: int = 0, shared_prefix: int = 0
) -> list[list[int]]:
    """``num`` random token-id prompts of ``min_len..max_len`` tokens (spread evenly);
    every second one starts with the same ``shared_prefix`` tokens (a system prompt)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 40000) for _ in range(shared_prefix)]
    out = []
    for i in range(num):
        n = min_len + (max_len - min_len) * i // max(1, num - 1)
        body = [rng.randrange(100, 40000) for _ in range(n)]
        if i % 2 and shared_prefix and n > shared_prefix:
            body[:shared_prefix] = prefix
        out.append(body)
    return out


def _signature(out: Any) -> list[tuple[Any, ...]]:
    """(token ids, per-token logprobs, top ids, top logprobs) of every completion."""
    sig = []
    for c in out.outputs:
        lps = c.logprobs or []
        sig.append(
            (
                tuple(c.token_ids),
                tuple(lp.sampled_logprob for lp in lps),
                tuple(tuple(lp.top_token_ids) for lp in lps),
                tuple(tuple(lp.top_logprobs) for lp in lps),
            )
        )
    return sig


def _groups(n: int, max_group: int, rng: random.Random) -> list[list[int]]:
    """A random split of ``range(n)`` (shuffled) into groups of 1..max_group."""
    order = list(range(n))
    rng.shuffle(order)
    out, i = [], 0
    while i < n:
        k = rng.randint(1, max_group)
        out.append(order[i : i + k])
        i += k
    return out


def check_invariance(
    prompts: list[list[int]],
    *,
    dtype: str = "auto",
    batch_invariant: bool | None = None,
    max_tokens: int = 8,
    max_num_seqs: int = 32,
    preempt_blocks: int | None = None,
    seed: int = 0,
    **engine_options: Any,
) -> InvarianceReport:
    """Run the modes of the module docstring and compare every request bitwise.

    ``preempt_blocks``: also run everything at once on this many KV blocks (small
    enough to force preemption). Extra ``engine_options`` go to every ``LLM``.
    """
    from kvserve.entrypoints.llm import LLM

    rng = random.Random(seed)
    longest = max(len(p) for p in prompts) + max_tokens + 16
    opts: dict[str, Any] = {
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max(longest, 256),
        "batch_invariant": batch_invariant,
        **engine_options,
    }
    params: list[SamplingParams] = []
    for i in range(len(prompts)):
        if i % 3 == 2:  # seeded sampling
            params.append(
                SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=max_tokens)
            )
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3))
    llm = LLM(**opts)
    report = InvarianceReport(
        dtype=str(getattr(llm.engine.loaded, "dtype", dtype)).removeprefix("torch."),
        batch_invariant=bool(getattr(llm.engine.runner, "batch_invariant", False)),
        num_prompts=len(prompts),
        prompt_lens=[len(p) for p in prompts],
        modes=["alone", "batched", "cache_hit"],
        invariant_max_context=int(getattr(llm.engine.runner, "invariant_max_context", 0)),
        weights=str(getattr(llm.engine.loaded, "quantization", "")),
    )

    def covered(i: int) -> bool:
        if report.batch_invariant:
            return True
        reach = report.invariant_max_context
        return len(prompts[i]) + max_tokens <= reach

    def run(idx: list[int], salt: str) -> dict[int, list[tuple[Any, ...]]]:
        outs = llm.generate(
            prompt_token_ids=[prompts[i] for i in idx],
            sampling_params=[params[i] for i in idx],
            use_tqdm=False,
            cache_salt=salt,
        )
        return {i: _signature(o) for i, o in zip(idx, outs, strict=True)}

    alone: dict[int, list[tuple[Any, ...]]] = {}
    for i in range(len(prompts)):
        alone.update(run([i], f"alone-{i}"))

    def compare(mode: str, got: dict[int, list[tuple[Any, ...]]]) -> None:
        tally = report.counts.setdefault(mode, {"guaranteed": [0, 0], "beyond": [0, 0]})
        for i, sig in sorted(got.items()):
            kind = "guaranteed" if covered(i) else "beyond"
            tally[kind][1] += 1
            if sig == alone[i]:
                tally[kind][0] += 1
            elif kind == "guaranteed":
                report.mismatches.append(f"{mode}: prompt {i} ({len(prompts[i])} tokens)")

    groups = _groups(len(prompts), max_num_seqs, rng)
    batched: dict[int, list[tuple[Any, ...]]] = {}
    for g in groups:
        batched.update(run(g, "batched"))
    compare("batched", batched)
    hits: dict[int, list[tuple[Any, ...]]] = {}
    for g in reversed(groups):
        hits.update(run(g, "batched"))
    compare("cache_hit", hits)
    if preempt_blocks is not None:
        report.modes.append("preempted")
        small = LLM(**{**opts, "num_kv_blocks": preempt_blocks})
        outs = small.generate(
            prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, cache_salt="p"
        )
        compare("preempted", {i: _signature(o) for i, o in enumerate(outs)})
    return report


def add_arguments(p: Any) -> None:
    """``kvserve bench invariance``: issue 25's targets over dtype x weights x mode."""
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=2000)
    p.add_argument("--shared-prefix", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--preempt-blocks", type=int, default=0, help="0: skip the preemption run")
    p.add_argument(
        "--weights",
        default="auto",
        help="comma-separated --quantization values: auto (the default GGUF's Q4_1), none",
    )
    p.add_argument(
        "--modes",
        default="default,invariant",
        help="comma-separated: default (automatic), invariant (--batch-invariant), off",
    )
    p.add_argument(
        "--disagg",
        action="store_true",
        help="also run every prompt through a prefill worker + decode worker (two "
        "`kvserve serve` processes on 127.0.0.1, default mode, default weights) per dtype",
    )


def run(args: Any) -> int:
    """One JSON line per configuration (counts per mode: [identical to alone, compared]
    for the requests the mode guarantees and those beyond its reach) and per dtype for
    ``--disagg``; exit status 1 when a guaranteed request differs."""
    import json
    import time

    mode_values = {"default": None, "invariant": True, "off": False}
    prompts = make_prompts(
        args.num_prompts, args.min_len, args.max_len, shared_prefix=args.shared_prefix
    )
    failed = False
    configs = [
        (d, w, m)
        for d in args.dtypes.split(",")
        for w in args.weights.split(",")
        for m in args.modes.split(",")
    ]
    for dtype, weights, mode in configs:
        if mode not in mode_values:
            print(json.dumps({"error": f"--modes: {mode!r} is not one of {sorted(mode_values)}"}))
            return 2
        t0 = time.perf_counter()
        try:
            rep = check_invariance(
                prompts,
                dtype=dtype,
                batch_invariant=mode_values[mode],
                max_tokens=args.max_tokens,
                max_num_seqs=args.max_num_seqs,
                preempt_blocks=args.preempt_blocks or None,
                quantization=weights,
            )
        except ValueError as e:  # a mode this build/CPU cannot run
            print(json.dumps({"dtype": dtype, "weights": weights, "mode": mode, "error": str(e)}))
            continue
        failed = failed or bool(rep.mismatches)
        print(
            json.dumps(
                {
                    "dtype": rep.dtype,
                    "weights": rep.weights,
                    "mode": mode,
                    "batch_invariant": rep.batch_invariant,
                    "invariant_max_context": rep.invariant_max_context,
                    "prompts": rep.num_prompts,
                    "prompt_lens": [min(rep.prompt_lens), max(rep.prompt_lens)],
                    "counts": rep.counts,
                    "mismatches": rep.mismatches,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            ),
            flush=True,
        )
    if args.disagg:
        for dtype in args.dtypes.split(","):
            t0 = time.perf_counter()
            res = check_disaggregated(
                prompts,
                dtype=dtype,
                max_tokens=args.max_tokens,
                max_model_len=max(len(p) for p in prompts) + args.max_tokens + 256,
            )
            failed = failed or bool(res["mismatches"])
            res.update(mode="disagg", dtype=dtype, seconds=round(time.perf_counter() - t0, 1))
            print(json.dumps(res), flush=True)
    return 1 if failed else 0
