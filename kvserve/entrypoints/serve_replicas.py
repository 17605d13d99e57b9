"""``kvserve serve --replicas N``: the same options, served by N engine replicas on Ray
Serve (:mod:`kvserve.cluster`, imported only when this runs).

The options are checked here, in the launching process, before Ray starts: a flag the
Ray Serve ingress cannot pass on, or a bad ``--model``, answers exit status 2 at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kvserve.engine.args import build_engine_config
from kvserve.entrypoints.serve_args import engine_options_from_args, http_options_from_args
from kvserve.kv_transfer.factory import kv_transfer_config_from_args


def ingress_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``build_app`` options the ingress applies itself, as one server does:
    function calling (the ingress parses tool calls out of the replicas' text),
    ``--seed`` (the ingress seeds unseeded requests in arrival order),
    ``--max-logprobs`` and request logging."""
    return {
        "tool_parser": args.tool_call_parser,
        "enable_auto_tool_choice": bool(args.enable_auto_tool_choice),
        "default_seed": args.seed,
        "max_logprobs": args.max_logprobs,
        "log_requests": bool(args.log_requests),
    }


def run_replicas(args: argparse.Namespace, api_key: str | None) -> int:
    """``--replicas N``, ``--min-replicas M --max-replicas X`` (autoscaled,
    ``cluster/autoscaling.py``) or ``--prefill-replicas P --decode-replicas D``
    (prefill/decode pools; the ``--kv-*`` tuning flags apply to them): the Ray Serve
    app (``kvserve.cluster``, imported only here).

    Returns the exit status: 2 (with the fix on stderr) for flags the cluster cannot
    honour, a bad model or a missing Ray; otherwise what the cluster returns."""
    disaggregated = args.prefill_replicas is not None or args.decode_replicas is not None
    if disaggregated and (args.min_replicas is not None or args.max_replicas is not None):
        print(
            "kvserve serve: --min-replicas/--max-replicas cannot be combined with "
            "--prefill-replicas/--decode-replicas: autoscaling covers identical engine "
            "replicas only; drop one",
            file=sys.stderr,
        )
        return 2
    try:
        from kvserve.cluster.app import ClusterOptions
        from kvserve.cluster.autoscaling import autoscaling_from_flags
        from kvserve.cluster.launcher import run_cluster
        from kvserve.cluster.policy import RoutingConfig
    except ImportError as e:
        print(
            f"kvserve serve: --replicas needs Ray Serve ({e}); install it with "
            "pip install -e '.[ray]' (make setup does)",
            file=sys.stderr,
        )
        return 2
    try:
        options, notices = engine_options_from_args(args)
        if disaggregated and args.replicas is not None:
            raise ValueError(
                "--replicas cannot be combined with --prefill-replicas/--decode-replicas: "
                "the pools are the deployment's size; drop --replicas"
            )
        scaling = (
            None
            if disaggregated
            else autoscaling_from_flags(
                replicas=args.replicas,
                min_replicas=args.min_replicas,
                max_replicas=args.max_replicas,
                target_ongoing_requests=args.target_ongoing_requests,
                upscale_delay_s=args.upscale_delay,
                downscale_delay_s=args.downscale_delay,
                look_back_s=args.autoscale_look_back,
                target_kv_usage=args.target_kv_usage,
                max_num_seqs=build_engine_config(**options).scheduler.max_num_seqs,
            )
        )
        # threads: this machine's cores over the most replicas that may run at once
        n = args.replicas if scaling is None else scaling.max_replicas
        if disaggregated:
            n = (args.prefill_replicas or 0) + (args.decode_replicas or 0)
        threads = args.threads_per_replica or max(1, (os.cpu_count() or 1) // max(n or 1, 1))
        for notice in notices:
            print(f"kvserve serve: {notice}", file=sys.stderr)
        if options.get("hash_algo") == "builtin":
            raise ValueError(
                "--hash-algo builtin gives different hashes in every process, so the router "
                "cannot predict the replicas' caches: use --hash-algo sha256 with --replicas"
            )
        lora = build_engine_config(**options).lora
        if lora is not None and lora.enable_lora:
            raise ValueError(
                "--enable-lora cannot be combined with --replicas yet (the ingress does not "
                "route adapters to the replicas): serve one engine with --enable-lora"
            )
        if not args.ray_address:  # fail fast on a bad --model (and convert it once, here)
            from kvserve.model.loader import (
                DEFAULT_MODEL_NAME,
                gguf_source,
                resolve_gguf_metadata,
                resolve_model,
            )

            model_name = options.get("model") or DEFAULT_MODEL_NAME
            gguf = gguf_source(model_name)
            if gguf is not None and options.get("quantization", "auto") != "none":
                resolve_gguf_metadata(gguf, Path(model_name).stem)  # runs quantized
            else:
                resolve_model(model_name)
        opts = ClusterOptions(
            num_replicas=None if scaling is not None else args.replicas,
            autoscaling=scaling,
            graceful_shutdown_timeout_s=float(args.graceful_shutdown_timeout),
            threads_per_replica=threads,
            engine_options=options,
            routing=RoutingConfig(policy=args.routing),
            served_model_name=args.served_model_name,
            api_key=api_key,
            max_queue_len=args.max_queue_len,
            min_healthy_replicas=args.min_healthy_replicas,
            ingress_replicas=args.ingress_replicas,
            http_options={**http_options_from_args(args), **ingress_options(args)},
            prefill_replicas=args.prefill_replicas,
            decode_replicas=args.decode_replicas,
            kv_transfer=kv_transfer_config_from_args(args, pools=disaggregated),
        )
    except (ValueError, TypeError) as e:
        print(f"kvserve serve: {e}", file=sys.stderr)
        return 2
    return run_cluster(opts, host=args.host, port=args.port, ray_address=args.ray_address)
