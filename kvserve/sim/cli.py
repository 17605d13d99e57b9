"""``kvserve simulate``: run the real schedulers on a workload file without a model.

    kvserve simulate WORKLOAD.json [--policy mixed|separated]
        [--max-num-batched-tokens N] [--max-num-seqs N] [--max-model-len N]
        [--block-size N] [--num-kv-blocks N] [--enable-prefix-caching |
        --no-enable-prefix-caching] [--num-batched-tokens-buckets 512,1024,...]
        [--num-seqs-buckets 1,2,4,8] [--long-prefill-token-threshold N]
        [--kv-segment-size N] [--max-step-ms MS] [--max-steps N] [--output FILE]

Prints (or writes to ``--output``) one JSON object::

    {"config": {...},
     "steps": [{"step": 0, "phase": "prefill", "num_scheduled_tokens": {"A": 508},
                "num_scheduled_tokens_padded": {"A": 512}, "num_computed_tokens": {"A": 0},
                "decode_batch_padded": null, "num_running": 1, "num_waiting": 0,
                "kv_usage": 0.1, "predicted_ms": 160.2}, ...],
     "requests": {"A": {"num_prompt_tokens": 2048, "num_cached_tokens": 0,
                        "num_output_tokens": 16, "first_scheduled_step": 0,
                        "first_token_step": 4, "finish_step": 19, "num_preemptions": 0}},
     "summary": {"num_steps": 20, "total_padding_tokens": 0,
                 "prefix_cache_hit_rate": 0.0, "num_preemptions": 0}}

``predicted_ms`` is the step's time by the fixed reference cost model
(``CostModel.reference``), which also sizes prompts beside decodes when
``--max-step-ms`` is given (off by default here, unlike the engine). ``num_computed_tokens`` is the value before the step; ``num_running``,
``num_waiting`` and ``kv_usage`` are taken right after scheduling the step.
Exit status: 0 done, 2 bad workload or configuration, 1 the run cannot finish (no
progress, or ``--max-steps`` reached). Errors go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any

from kvserve.config import DEFAULT_MAX_MODEL_LEN, CacheConfig, SchedulerConfig
from kvserve.sim.runner import DEFAULT_MAX_STEPS, SimulationError, simulate
from kvserve.sim.workload import load_workload

# flag dest -> SchedulerConfig field
_CONFIG_FLAGS = {
    "policy": "scheduler_policy",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len",
    "num_batched_tokens_buckets": "num_batched_tokens_buckets",
    "num_seqs_buckets": "num_seqs_buckets",
    "long_prefill_token_threshold": "long_prefill_token_threshold",
    "prefill_budget_with_decodes": "prefill_budget_with_decodes",
    "max_step_ms": "max_step_ms",
}
# flag dest -> CacheConfig field (the KV cache owns these)
_CACHE_FLAGS = ("block_size", "enable_prefix_caching", "kv_segment_size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for c in (SchedulerConfig, CacheConfig) for f in fields(c)}
    defaults["max_model_len"] = DEFAULT_MAX_MODEL_LEN
    parser.add_argument("workload", metavar="WORKLOAD.json", help="workload file ('-' = stdin)")
    parser.add_argument(
        "--policy",
        choices=("mixed", "separated"),
        help=f"scheduling policy (default: {defaults['scheduler_policy']})",
    )
    for flag, help_text in (
        ("--max-num-batched-tokens", "token budget per step"),
        ("--max-num-seqs", "most requests running at once"),
        ("--max-model-len", "longest prompt + output a request may have"),
        ("--block-size", "tokens per KV block (power of two)"),
        (
            "--long-prefill-token-threshold",
            "mixed policy: cap on one prompt's chunk when several compete (0 = off)",
        ),
        (
            "--prefill-budget-with-decodes",
            "mixed policy: most prompt tokens in a step that also decodes (0 = off)",
        ),
        ("--kv-segment-size", "0, 512, 1024, 2048 or 4096 (a multiple of the block size)"),
    ):
        dest = flag[2:].replace("-", "_")
        parser.add_argument(
            flag, type=int, metavar="N", help=f"{help_text} (default: {defaults[dest]})"
        )
    parser.add_argument(
        "--max-step-ms",
        type=float,
        metavar="MS",
        help="target ms of a step that also decodes, sized by the fixed reference cost model "
        "(kvserve.sched.cost_model.CostModel.reference, not this machine's; default: 0 = off, "
        f"token budgets only; the engine's default is {defaults['max_step_ms']})",
    )
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        metavar="N",
        help="KV blocks including the null block 0 (default: max_num_seqs requests of max_model_len)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse KV of shared prompt prefixes (default: on)",
    )
    parser.add_argument(
        "--num-batched-tokens-buckets",
        metavar="B1,B2,...",
        help="separated policy: prefill chunk buckets, ascending, last = "
        "min(max_num_batched_tokens, max_model_len) (default: powers of two from 128)",
    )
    parser.add_argument(
        "--num-seqs-buckets",
        metavar="B1,B2,...",
        help="separated policy: decode batch buckets, ascending, last = max_num_seqs "
        "(default: powers of two from 1)",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=DEFAULT_MAX_STEPS,
        metavar="N",
        help=f"give up (exit 1) after this many steps (default: {DEFAULT_MAX_STEPS})",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help="refuse token ids >= N (default: a simulator has no vocabulary, any id >= 0 is accepted)",
    )
    parser.add_argument("--output", metavar="FILE", help="write the JSON here instead of stdout")


def _parse_int_list(name: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(
            f"invalid {name}={text!r}: must be comma-separated integers (for example: {name}=1,2,4,8)"
        ) from None


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    """The SchedulerConfig the flags describe (unset flags keep the defaults); validated."""
    overrides: dict[str, Any] = {}
    for dest, field_name in _CONFIG_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest in ("num_batched_tokens_buckets", "num_seqs_buckets"):
            value = _parse_int_list(dest, value)
        overrides[field_name] = value
    # The simulator's cost model is a fixed reference, not a measured one: its time
    # budget is opt-in, so traces stay in token terms unless asked.
    overrides.setdefault("max_step_ms", 0.0)
    config = SchedulerConfig(**overrides)
    config.resolved()  # validates (once per configuration)
    return config


def cache_config_from_args(args: argparse.Namespace) -> CacheConfig:
    """The CacheConfig the flags describe (block size, prefix caching, KV segment
    size; unset flags keep the defaults); validated."""
    given = {
        name: getattr(args, name) for name in _CACHE_FLAGS if getattr(args, name, None) is not None
    }
    cache = CacheConfig(**given)
    cache.validate()
    return cache


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        cache = cache_config_from_args(args)
        workload = load_workload(args.workload)
        result = simulate(
            workload,
            config,
            cache=cache,
            num_kv_blocks=args.num_kv_blocks,
            max_steps=args.max_steps,
            vocab_size=args.vocab_size,
        )
    except ValueError as e:
        print(f"kvserve simulate: error: {e}", file=sys.stderr)
        return 2
    except SimulationError as e:
        print(f"kvserve simulate: cannot finish: {e}", file=sys.stderr)
        return 1
    text = json.dumps(result, indent=1)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:
            print(
                f"kvserve simulate: error: cannot write {args.output!r}: {e.strerror or e}",
                file=sys.stderr,
            )
            return 2
    else:
        sys.stdout.write(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``kvserve simulate`` as a function (tests call it in-process)."""
    parser = argparse.ArgumentParser(
        prog="kvserve simulate",
        description="run the real schedulers on a workload file without a model",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
