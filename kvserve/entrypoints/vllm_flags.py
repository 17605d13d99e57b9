"""``kvserve serve`` flags that vLLM's ``vllm serve`` has: the positional model,
``--seed``, ``--generation-config``, ``--max-logprobs``, ``--root-path``,
``--uvicorn-log-level``, ``--enable-log-requests`` / ``--disable-log-requests``,
``--enable-chunked-prefill`` / ``--no-enable-chunked-prefill``, function calling
(``--enable-auto-tool-choice``, ``--tool-call-parser``), ``--metrics-prefix``,
and the GPU-only flags kvserve accepts with a notice or refuses with the
alternative (``kvserve.engine.vllm_compat``)."""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.engine.vllm_compat import translate_vllm_options
from kvserve.entrypoints.chat.tool_parsers import TOOL_PARSERS

MAX_LOGPROBS = 20  # the sampler's most top logprobs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model (as vllm serve MODEL): same as --model",
    )
    g = parser.add_argument_group("vLLM-compatible options")
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="engine-wide seed: requests without a seed draw theirs from it, so the same "
        "requests in the same order sample the same tokens (default: unseeded)",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        help="default sampling (temperature, top_p, top_k, min_p, repetition_penalty): auto = "
        "the model's generation_config.json (default), vllm = none, or a FOLDER holding one",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help=f"most logprobs / top_logprobs / prompt_logprobs a request may ask for "
        f"(default and most: {MAX_LOGPROBS})",
    )
    g.add_argument("--root-path", default="", help="the path prefix a proxy serves this app under")
    g.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: --log-level)",
    )
    g.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        default=False,
        help="log one line per generation request (prompt length, sampling)",
    )
    g.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help="do not log requests (the default)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split long prompts across steps (kvserve's default); --no-enable-chunked-prefill "
        "runs each prompt in one chunk",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": read tool calls out of the model\'s text with '
        "--tool-call-parser (docs/function-calling.md)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="the format the model writes calls in (hermes for the SmolLM2 tool template)",
    )
    g.add_argument(
        "--metrics-prefix",
        default="vllm:",
        help="/metrics also lists every kvserve: series under this prefix, for vLLM "
        "dashboards (default vllm:; 'none' for kvserve: only)",
    )
    gpu = parser.add_argument_group("vLLM GPU options (accepted with a notice, or refused)")
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size"):
        short = {"--tensor-parallel-size": "-tp", "--pipeline-parallel-size": "-pp"}.get(flag)
        names = [flag, short] if short else [flag]
        gpu.add_argument(*names, type=int, default=None, help="1 only (see --replicas)")
    gpu.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of the RAM available at start given to the KV cache",
    )
    gpu.add_argument("--enforce-eager", action="store_true", default=None, help="no effect")
    gpu.add_argument("--trust-remote-code", action="store_true", default=None, help="no effect")
    gpu.add_argument("--swap-space", type=float, default=None, help="no effect")
    gpu.add_argument("--disable-log-stats", action="store_true", default=None, help="no effect")
    gpu.add_argument("--tokenizer", default=None, help="the model's own only")


def engine_options(
    args: argparse.Namespace, options: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The engine options with the positional model and vLLM's GPU flags applied,
    and the notices to log; ValueError for what cannot be honoured."""
    options = dict(options)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if options.get("model") not in (None, tag):
            raise ValueError(
                f"the model is given twice ({tag!r} and --model {options['model']!r}): give one"
            )
        options["model"] = tag
    if getattr(args, "max_logprobs", MAX_LOGPROBS) > MAX_LOGPROBS:
        raise ValueError(
            f"--max-logprobs {args.max_logprobs} cannot be honoured: kvserve returns at most "
            f"{MAX_LOGPROBS} top logprobs; use --max-logprobs {MAX_LOGPROBS} or less"
        )
    if getattr(args, "max_logprobs", 0) < 0:
        raise ValueError("--max-logprobs must be >= 0, e.g. 20")
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        raise ValueError(
            "--tool-call-parser reads calls for tool_choice auto, which is off: add "
            "--enable-auto-tool-choice"
        )
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser NAME (hermes, llama3_json or "
            "pythonic), the format the model writes its calls in"
        )
    vllm = {
        name: getattr(args, name, None)
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "gpu_memory_utilization",
            "enforce_eager",
            "trust_remote_code",
            "enable_chunked_prefill",
            "swap_space",
            "disable_log_stats",
            "tokenizer",
        )
    }
    if vllm["tokenizer"] is not None and vllm["tokenizer"] == tag:
        vllm["tokenizer"] = options.get("model")
    return translate_vllm_options({**options, **vllm})


def metrics_prefix(value: str) -> str | None:
    from kvserve.entrypoints.extras import check_metrics_prefix

    if value.lower() == "none":
        return None
    return check_metrics_prefix(value)
