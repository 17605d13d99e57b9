"""The command line of ``kvserve serve``: every flag is added and parsed here.

:func:`add_arguments` adds the server's own flags, the engine's (one per
:data:`kvserve.engine.args.OPTIONS` entry), the KV-transfer ones
(:mod:`kvserve.kv_transfer.factory`) and vLLM's (the positional model, ``--seed``,
``--generation-config``, ``--max-logprobs``, ``--root-path``, tool-choice flags,
``--metrics-prefix``, GPU-only flags). The readers turn a parsed namespace into what
the server takes: :func:`engine_options_from_args` (engine options with vLLM's names
translated, :mod:`kvserve.engine.vllm_compat`), :func:`http_options_from_args`
(``build_app`` keywords), :func:`uvicorn_limits_from_args`, :func:`metrics_prefix`.
Both the one-engine server and ``--replicas`` read them. docs/configuration.md
lists every flag and every ``KVSERVE_*`` environment switch.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.engine.args import add_engine_arguments, engine_kwargs_from_args
from kvserve.engine.request_limits import DEFAULT_MAX_PROMPTS_PER_REQUEST
from kvserve.engine.vllm_compat import VLLM_OPTIONS, translate_vllm_options
from kvserve.entrypoints.chat.tool_parsers import TOOL_PARSERS
from kvserve.entrypoints.http_protocol import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
)
from kvserve.kv_transfer.factory import add_kv_transfer_arguments

MAX_LOGPROBS = 20  # the sampler's most top logprobs


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 such as 64, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (default: "
        "$KVSERVE_API_KEY)",
    )
    parser.add_argument(
        "--allow-unauthenticated-metrics",
        action="store_true",
        help="with --api-key, leave /metrics open (for a scraper without credentials)",
    )
    parser.add_argument(
        "--max-queue-len",
        type=_non_negative_int,
        default=None,
        help="answer 429 + Retry-After when a request's sequences (prompts x n) would make "
        "more than this many wait to be scheduled (default: no limit)",
    )
    parser.add_argument(
        "--max-prompts-per-request",
        type=_non_negative_int,
        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
        help="refuse (400) a completions request with more prompts than this (default "
        f"{DEFAULT_MAX_PROMPTS_PER_REQUEST}; 0: no limit)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model's own name)",
    )
    hardening = parser.add_argument_group("chat templates and request limits (docs/security.md)")
    hardening.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|STRING",
        help="the chat template: a .jinja file or the template text (default: the model's own)",
    )
    hardening.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat_template (default: refused with 400; a "
        "template is code, so only for trusted clients)",
    )
    hardening.add_argument(
        "--chat-template-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a chat template render past this is stopped and answered 400 (default 5)",
    )
    hardening.add_argument(
        "--max-request-body-bytes",
        type=_non_negative_int,
        default=None,
        help="answer 413 for larger bodies (default: max(8 MiB, 64 x max_model_len x "
        "max_num_seqs))",
    )
    hardening.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="send CORS headers for these origins ('*' for any; default: none, so browsers "
        "keep other sites' pages from reading answers)",
    )
    hardening.add_argument(
        "--max-header-bytes",
        type=_non_negative_int,
        default=DEFAULT_MAX_HEADER_BYTES,
        help="answer 431 and close when a request line and headers pass this many bytes "
        f"(default {DEFAULT_MAX_HEADER_BYTES})",
    )
    hardening.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="answer 408 and close a connection whose request headers take longer "
        f"(slowloris; default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    hardening.add_argument(
        "--timeout-keep-alive",
        type=_non_negative_int,
        default=5,
        metavar="SECONDS",
        help="close an idle keep-alive connection after this long (default 5)",
    )
    hardening.add_argument(
        "--limit-concurrency",
        type=_non_negative_int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="answer 503 + Retry-After past this many open connections or requests in "
        f"progress (default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--graceful-shutdown-timeout",
        type=_non_negative_int,
        default=30,
        help="seconds in-flight requests get to finish after SIGTERM (default 30)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default info)",
    )
    parser.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log one line per HTTP request (default on)",
    )
    scale = parser.add_argument_group(
        "scale-out (Ray Serve; needs the 'ray' extra: pip install -e '.[ray]')"
    )
    scale.add_argument(
        "--replicas",
        type=_non_negative_int,
        default=None,
        help="run N >= 2 engine replicas on Ray Serve behind this endpoint (default: one "
        "engine in this process)",
    )
    scale.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. 10.0.0.5:6379 after 'ray start --head'); default: "
        "start a local one on 127.0.0.1",
    )
    scale.add_argument(
        "--threads-per-replica",
        type=_non_negative_int,
        default=None,
        help="torch threads of each replica (default: this machine's cores / N)",
    )
    scale.add_argument(
        "--min-healthy-replicas",
        type=_non_negative_int,
        default=None,
        help="GET /health answers 503 while fewer replicas than this are alive (default: "
        "all --replicas)",
    )
    scale.add_argument(
        "--min-replicas",
        type=_non_negative_int,
        default=None,
        help="autoscale the engine replicas: at least this many (>= 1; with --max-replicas; "
        "--replicas is then the starting size, default --min-replicas)",
    )
    scale.add_argument(
        "--max-replicas",
        type=_non_negative_int,
        default=None,
        help="autoscale the engine replicas: at most this many (>= 2, >= --min-replicas)",
    )
    scale.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling target: requests per replica (running plus queued) Ray Serve keeps "
        "(default: the engine's --max-num-seqs)",
    )
    scale.add_argument(
        "--upscale-delay",
        type=float,
        default=None,
        help="autoscaling: seconds the load stays above target before a replica is added "
        "(default 30)",
    )
    scale.add_argument(
        "--downscale-delay",
        type=float,
        default=None,
        help="autoscaling: seconds the load stays below target before a replica is drained "
        "and removed (default 600)",
    )
    scale.add_argument(
        "--autoscale-look-back",
        type=float,
        default=None,
        help="autoscaling: seconds of load Ray Serve averages over (default 30); the load "
        "is reported every look-back / 3 s (at most 10)",
    )
    scale.add_argument(
        "--target-kv-usage",
        type=float,
        default=None,
        help="autoscaling: add replicas while the replicas' KV blocks held by requests "
        "exceed this fraction on average (default 0.8; docs/scale-out.md#autoscaling)",
    )
    scale.add_argument(
        "--ingress-replicas",
        type=int,
        default=1,
        help="with --replicas or autoscaling: HTTP ingress processes behind Ray Serve's "
        "proxy (default 1); each tokenizes and routes its own requests, and all share "
        "where prefixes live through the replicas' reports (docs/scale-out.md)",
    )
    scale.add_argument(
        "--routing",
        default="prefix-aware",
        choices=["prefix-aware", "round-robin", "least-loaded"],
        help="request routing across replicas (default prefix-aware)",
    )
    for role in ("prefill", "decode"):
        scale.add_argument(
            f"--{role}-replicas",
            type=_non_negative_int,
            default=None,
            help=f"disaggregated serving on Ray Serve: {role} pool size (>= 1, with "
            f"--{'decode' if role == 'prefill' else 'prefill'}-replicas; "
            "docs/scale-out.md#prefilldecode-pools)",
        )
    add_engine_arguments(parser)
    add_kv_transfer_arguments(parser)
    _add_vllm_arguments(parser)


def uvicorn_limits_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments of the connection flags (the bounded
    protocol class, keep-alive, concurrency); ValueError with the flag at fault."""
    from kvserve.entrypoints.http_protocol import guarded_protocol

    limit = args.limit_concurrency or DEFAULT_MAX_CONNECTIONS
    return {
        "http": guarded_protocol(
            max_header_bytes=args.max_header_bytes,
            header_timeout_s=args.header_timeout,
            max_connections=limit,
        ),
        "timeout_keep_alive": args.timeout_keep_alive,
        "limit_concurrency": limit,
    }


def http_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``build_app`` keyword arguments of the chat/limits flags; raises ValueError
    (with the fix) for a template that cannot be read or compiled."""
    from kvserve.entrypoints.chat.template import TemplateError, load_chat_template

    out: dict[str, Any] = {
        "trust_request_chat_template": bool(args.trust_request_chat_template),
        "max_request_body_bytes": args.max_request_body_bytes or None,
        "allowed_origins": args.allowed_origins or None,
    }
    if args.chat_template is not None:
        try:
            out["chat_template"] = load_chat_template(args.chat_template)
        except TemplateError as e:
            raise ValueError(f"--chat-template: {e}") from None
    if args.chat_template_timeout is not None:
        if not args.chat_template_timeout > 0:
            raise ValueError(
                f"--chat-template-timeout must be > 0 seconds, got {args.chat_template_timeout}"
            )
        out["chat_template_timeout_s"] = args.chat_template_timeout
    return out


def _add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``vllm serve`` flags: the positional model, the vLLM-compatible group and
    the GPU-only flags (accepted with a notice or refused, :mod:`kvserve.engine.vllm_compat`)."""
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


def engine_options_from_args(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The engine options of the command line (:func:`~kvserve.engine.args.engine_kwargs_from_args`)
    with the positional model and vLLM's GPU flags applied, and the notices to log;
    ValueError for what cannot be honoured."""
    options = engine_kwargs_from_args(args)
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
    vllm = {name: getattr(args, name, None) for name in VLLM_OPTIONS}
    if vllm["tokenizer"] is not None and vllm["tokenizer"] == tag:
        vllm["tokenizer"] = options.get("model")
    return translate_vllm_options({**options, **vllm})


def metrics_prefix(value: str) -> str | None:
    from kvserve.entrypoints.extras import check_metrics_prefix

    if value.lower() == "none":
        return None
    return check_metrics_prefix(value)
