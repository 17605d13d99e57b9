"""``kvserve bench serve``: load-test any OpenAI-compatible server (kvserve, vLLM,
llama.cpp's server) with one workload; report and plots in ``--output``.

Heavy imports (httpx, numpy, matplotlib, transformers) happen inside :func:`run`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from kvserve.bench.workloads import WORKLOAD_KINDS

# every workload kind but multi-tenant, which only the presets run (its Zipf skew has
# no flag here)
WORKLOADS = tuple(kind for kind in WORKLOAD_KINDS if kind != "multi-tenant")


def request_rate(text: str) -> float:
    """``--request-rate``: a number > 0 or ``inf``; refused with an example otherwise."""
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvserve bench serve`` (every default is what a bare run uses)."""
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
        type=request_rate,
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


def vocabulary(tokenizer_name: str | None, required: bool) -> Any:
    """Exact-length words from ``tokenizer_name``'s tokenizer, or the default words.

    With ``required`` a tokenizer that cannot be loaded is an error; without it the
    default (approximate) vocabulary is used after a warning.
    """
    from kvserve.bench.vocabulary import WordVocabulary

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


def run(args: argparse.Namespace) -> int:
    """``kvserve bench serve``: 0 when any request completed, 1 when none did, 2 (with
    the fix on stderr) for bad options or a server that cannot be reached."""
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
        workload = build_workload(spec, vocabulary(args.tokenizer, required=True))
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
