"""The command-line options of ``kvserve serve`` (:mod:`kvserve.entrypoints.serve_cmd`).

:func:`add_arguments` adds the server's own flags, then the engine's
(:mod:`kvserve.engine.args`), the KV-transfer ones and vLLM's (:mod:`vllm_flags`);
:func:`http_options_from_args` turns the chat/limits flags into ``build_app`` keyword
arguments. Both the one-engine server and ``--replicas`` read them.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.engine.args import add_engine_arguments
from kvserve.engine.request_limits import DEFAULT_MAX_PROMPTS_PER_REQUEST
from kvserve.entrypoints import vllm_flags
from kvserve.entrypoints.http_protocol import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
)
from kvserve.kv_transfer.factory import add_kv_transfer_arguments


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
            help=f"{role} pool size for disaggregated serving: not available yet (the "
            "prefill/decode roles have not landed; the flag is refused)",
        )
    add_engine_arguments(parser)
    add_kv_transfer_arguments(parser)
    vllm_flags.add_arguments(parser)


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
