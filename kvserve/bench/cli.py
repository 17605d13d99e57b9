"""``kvserve bench {serve,compare,step-cost,forward}``.

- ``serve``: load-test any OpenAI-compatible server (kvserve, vLLM, llama.cpp).
- ``compare``: run a preset against several kvserve configurations (each started as
  ``kvserve serve``) and the HF transformers baseline; print a table of ratios.
- ``step-cost``: the step-time cost model's prediction error on real steps
  (``kvserve.bench.step_cost``).
- ``forward``: the model forward-pass benchmark, implemented in
  ``kvserve.bench.forward`` (imported when the parser is built, like the top-level
  subcommands; "not yet available" while that module is missing).

Heavy imports (httpx, numpy, matplotlib, transformers) happen inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

WORKLOADS = (
    "random",
    "shared-prefix",
    "multi-turn",
    "long-doc",
    "interference",
    "chat-interference",
    "chat-multiturn",
    "spec-edit",
    "spec-code",
    "spec-json",
    "spec-quote",
)
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


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid request rate {text!r}: give a number or 'inf' (e.g. 4)"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(
            f"invalid request rate {text!r}: must be > 0 or inf (e.g. 4)"
        )
    return value


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server root URL (default: %(default)s)"
    )
    g.add_argument(
        "--model", default=None, help="model name to request (default: first of GET /v1/models)"
    )
    g.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions (default: %(default)s)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $KVSERVE_API_KEY or $OPENAI_API_KEY)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer (model name, folder or .gguf) for exact prompt lengths; "
        "without it prompts use ~1 token per word (approximate)",
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)"
    )
    g.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (outputs may end before --output-len)",
    )
    g.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request (default: 600)"
    )

    g = p.add_argument_group("load")
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="workload kind (default: %(default)s)",
    )
    g.add_argument(
        "--num-requests", type=int, default=64, help="requests in total (default: %(default)s)"
    )
    g.add_argument(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="Poisson arrivals per second; 'inf' sends all at once (default: inf)",
    )
    g.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson"
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (default: none)",
    )
    g.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: 0)")
    g.add_argument(
        "--warmup", type=int, default=0, help="short untimed requests before the run (default: 0)"
    )

    g = p.add_argument_group("workload sizes (tokens)")
    g.add_argument(
        "--input-len",
        type=int,
        default=256,
        help="prompt / question / user-turn length (default: 256)",
    )
    g.add_argument(
        "--output-len", type=int, default=64, help="output tokens per request (default: 64)"
    )
    g.add_argument(
        "--range-ratio", type=float, default=0.0, help="random: lengths vary by ±ratio (default: 0)"
    )
    g.add_argument(
        "--prefix-len", type=int, default=1024, help="shared-prefix: system prompt length"
    )
    g.add_argument(
        "--num-prefixes", type=int, default=4, help="shared-prefix: number of system prompts"
    )
    g.add_argument(
        "--turns", type=int, default=4, help="multi-turn, chat-multiturn: turns per conversation"
    )
    g.add_argument("--num-docs", type=int, default=2, help="long-doc: number of documents")
    g.add_argument("--doc-len", type=int, default=2048, help="long-doc: document length")
    g.add_argument(
        "--num-decodes", type=int, default=8, help="interference: streaming decodes started at t=0"
    )
    g.add_argument(
        "--num-long-prompts", type=int, default=4, help="interference: long prompts arriving later"
    )
    g.add_argument(
        "--long-prompt-len", type=int, default=2048, help="interference: long prompt length"
    )
    g.add_argument(
        "--long-prompt-start", type=float, default=0.5, help="interference: first long prompt (s)"
    )
    g.add_argument(
        "--long-prompt-gap",
        type=float,
        default=1.5,
        help="interference: gap between long prompts (s)",
    )

    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in ms for goodput")
    g.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in ms for goodput")
    g.add_argument(
        "--slo-e2e", type=float, default=None, help="end-to-end latency SLO in ms for goodput"
    )
    g.add_argument("--output", type=Path, default=Path("bench_results/serve"), help="output folder")
    g.add_argument("--no-plots", action="store_true", help="write results.json only")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_compare_arguments(p: argparse.ArgumentParser) -> None:
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
        "--request-rate", type=_rate, default=None, help="override the preset's arrival rate"
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench sub-subcommands to ``parser`` (the ``kvserve bench`` parser)."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    p = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server",
        description="Load-test any OpenAI-compatible server (kvserve, vLLM, llama.cpp's server): "
        "stream every request, report throughput, TTFT/TPOT/ITL/E2E percentiles, goodput and "
        "the prefix-cache hit rate, and write results.json and PNG plots.",
    )
    _add_serve_arguments(p)
    p.set_defaults(_bench_run=run_serve)
    p = sub.add_parser(
        "compare",
        help="compare kvserve configurations and the HF baseline",
        description="Run one preset workload against several kvserve configurations, each started "
        "as its own `kvserve serve`, plus the HF transformers static-batching baseline, and print "
        "each figure with its ratio to a reference configuration.",
    )
    _add_compare_arguments(p)
    p.set_defaults(_bench_run=run_compare)
    from kvserve.bench import step_cost

    p = sub.add_parser(
        "step-cost",
        help="the step-time cost model's prediction error on real steps",
        description=step_cost.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    step_cost.add_arguments(p)
    p.set_defaults(_bench_run=step_cost.run)
    from kvserve.bench import invariance

    p = sub.add_parser(
        "invariance",
        help="batch invariance: alone vs batched vs cache hit vs disaggregated, bitwise",
        description=invariance.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    invariance.add_arguments(p)
    p.set_defaults(_bench_run=invariance.run)
    p = sub.add_parser("forward", help="model forward-pass benchmark")
    try:
        forward = importlib.import_module("kvserve.bench.forward")
    except ModuleNotFoundError as e:
        if e.name != "kvserve.bench.forward":
            raise
        p.set_defaults(_bench_run=_forward_unavailable)
    else:
        forward.add_arguments(p)
        p.set_defaults(_bench_run=forward.run)


def run(args: argparse.Namespace) -> int:
    """Dispatch to the chosen bench command; 2 when none was chosen."""
    if getattr(args, "_bench_run", None) is None:
        print(
            "usage: kvserve bench {serve,compare,step-cost,invariance,forward} ... "
            "(see kvserve bench -h)",
            file=sys.stderr,
        )
        return 2
    return int(args._bench_run(args) or 0)


def _forward_unavailable(args: argparse.Namespace) -> int:
    print("kvserve bench forward: not yet available in this version", file=sys.stderr)
    return 2


def _vocabulary(tokenizer_name: str | None, required: bool) -> Any:
    """Exact-length words from ``tokenizer_name``'s tokenizer, or the default words.

    With ``required`` a tokenizer that cannot be loaded is an error; without it the
    default (approximate) vocabulary is used after a warning.
    """
    from kvserve.bench.workloads import WordVocabulary

    if tokenizer_name is None:
        return WordVocabulary.default()
    from kvserve.bench.hf_baseline import load_tokenizer

    try:
        return WordVocabulary.from_tokenizer(load_tokenizer(tokenizer_name))
    except (ValueError, OSError) as e:
        if required:
            raise ValueError(f"--tokenizer {tokenizer_name!r}: {e}") from e
        print(f"warning: {e}; prompt lengths are approximate (~1 token per word)", file=sys.stderr)
        return WordVocabulary.default()


def run_serve(args: argparse.Namespace) -> int:
    from kvserve.bench.loadgen import LoadConfig, run_workload
    from kvserve.bench.metrics import SLO
    from kvserve.bench.report import build_report, format_summary, write_report
    from kvserve.bench.workloads import WorkloadSpec, build_workload

    try:
        spec = WorkloadSpec(
            kind=args.workload,
            num_requests=args.num_requests,
            seed=args.seed,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            prefix_len=args.prefix_len,
            num_prefixes=args.num_prefixes,
            turns=args.turns,
            num_docs=args.num_docs,
            doc_len=args.doc_len,
            num_decodes=args.num_decodes,
            num_long_prompts=args.num_long_prompts,
            long_prompt_len=args.long_prompt_len,
            long_prompt_start_s=args.long_prompt_start,
            long_prompt_gap_s=args.long_prompt_gap,
        )
        slo = SLO(args.slo_ttft, args.slo_tpot, args.slo_e2e)
        slo.validate()
        config = LoadConfig(
            base_url=args.base_url,
            model=args.model,
            endpoint=args.endpoint,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            api_key=args.api_key,
            ignore_eos=not args.no_ignore_eos,
            temperature=args.temperature,
            request_timeout_s=args.request_timeout,
            num_warmup=args.warmup,
            progress=not args.no_progress,
        )
        config.validate()
        workload = build_workload(spec, _vocabulary(args.tokenizer, required=True))
        run = run_workload(workload, config)
    except (ValueError, RuntimeError) as e:
        print(f"kvserve bench serve: {e}", file=sys.stderr)
        return 2
    cfg = run.config_json() | {"tokenizer": args.tokenizer}
    report = build_report(
        run.results,
        run.duration_s,
        workload,
        slo,
        cfg,
        run.prefix_cache,
        spec_decode=run.spec_decode,
    )
    paths = write_report(
        report, run.results, args.output, plots=not args.no_plots, title=args.workload
    )
    print(format_summary(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if report["summary"]["completed"] > 0 else 1


def run_compare(args: argparse.Namespace) -> int:
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
        vocab = _vocabulary(
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
