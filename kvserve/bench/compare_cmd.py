"""``kvserve bench compare``: one preset against several kvserve configurations (each
started as ``kvserve serve``) and the HF transformers baseline, as a table of ratios.

Heavy imports happen inside :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from kvserve.bench.serve_bench import request_rate, vocabulary

PRESET_NAMES = (
    "prefix",
    "chunking",
    "policy",
    "throughput",
    "routing",
    "disagg",
    "interference",
    "multiturn",
    "random-c16",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvserve bench compare``."""
    p.add_argument("preset", choices=PRESET_NAMES, help="which comparison to run")
    p.add_argument(
        "--model", default=None, help="model for every configuration (default: kvserve's default)"
    )
    p.add_argument(
        "--output",
        type=Path,
        default=None,
        help="output folder (default: bench_results/compare/PRESET)",
    )
    p.add_argument(
        "--reference", default=None, help="variant the ratios divide by (default: the preset's)"
    )
    p.add_argument(
        "--engine-args",
        default="",
        help="extra `kvserve serve` arguments for every kvserve configuration (quoted)",
    )
    p.add_argument(
        "--serve-command",
        default=None,
        help="server command to which --host/--port/--model/engine args are appended "
        "(default: this Python's `-m kvserve.entrypoints.cli serve`)",
    )
    p.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for /health"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer for exact prompt lengths (default: the model's)",
    )
    p.add_argument(
        "--hf-batch-size", type=int, default=8, help="HF baseline batch size (default: 8)"
    )
    p.add_argument("--skip-hf", action="store_true", help="leave out the HF transformers baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-requests", type=int, default=None, help="override the preset's request count"
    )
    p.add_argument(
        "--request-rate", type=request_rate, default=None, help="override the preset's arrival rate"
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="override the preset's cap on requests in flight",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, interleaved, and report medians "
        "(default: 1)",
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    """``kvserve bench compare``: 0 when every configuration ran, 1 when any failed (the
    errors on stderr), 2 for bad options."""
    from kvserve.bench.compare import (
        PRESETS,
        CompareOptions,
        format_result,
        serve_command_from_string,
    )
    from kvserve.bench.compare import run_compare as run_preset
    from kvserve.bench.hf_baseline import DEFAULT_MODEL

    preset = PRESETS[args.preset]
    if args.num_requests is not None:
        preset = replace(preset, workload=replace(preset.workload, num_requests=args.num_requests))
    if args.request_rate is not None:
        preset = replace(preset, request_rate=args.request_rate)
    if args.max_concurrency is not None:
        preset = replace(preset, max_concurrency=args.max_concurrency)
    try:
        opts = CompareOptions(
            model=args.model,
            output_dir=args.output or Path("bench_results/compare") / preset.name,
            serve_command=serve_command_from_string(args.serve_command),
            extra_engine_args=tuple(shlex.split(args.engine_args)),
            reference=args.reference,
            startup_timeout_s=args.startup_timeout,
            hf_batch_size=args.hf_batch_size,
            skip_hf=args.skip_hf,
            seed=args.seed,
            progress=not args.no_progress,
            plots=not args.no_plots,
            rounds=args.rounds,
        )
        vocab = vocabulary(
            args.tokenizer or args.model or DEFAULT_MODEL, required=args.tokenizer is not None
        )
        result = run_preset(preset, opts, vocab)
    except ValueError as e:
        print(f"kvserve bench compare: {e}", file=sys.stderr)
        return 2
    print(format_result(result))
    print(f"wrote {opts.output_dir / 'compare.json'}")
    if result["errors"]:
        print(json.dumps(result["errors"], indent=1)[:2000], file=sys.stderr)
        return 1
    return 0
