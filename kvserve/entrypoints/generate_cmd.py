"""``kvserve generate``: one prompt in, the completion streamed to stdout."""

from __future__ import annotations

import argparse
import sys

from kvserve.engine.args import add_engine_arguments, build_engine_config, engine_kwargs_from_args
from kvserve.request import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt", required=True, help="the prompt text (the user message with --chat)"
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="tokens to generate (default 128)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
        )
        config = build_engine_config(**engine_kwargs_from_args(args))
    except (ValueError, TypeError) as e:
        print(f"kvserve generate: {e}", file=sys.stderr)
        return 2
    from kvserve.engine.engine_core import EngineCore

    engine = EngineCore(config)
    from kvserve.model.memory import memory_report

    print(
        f"kvserve generate: {engine.model_name} "
        f"(dtype={engine.loaded.dtype_name}, "
        f"attention={engine.runner.attention_backend}); "
        f"resident memory: {memory_report(engine).describe()}",
        file=sys.stderr,
    )
    tok = engine.tokenizer
    if args.chat:
        from kvserve.entrypoints.chat.prompt import ChatPromptBuilder

        prompt = ChatPromptBuilder(tok).build([{"role": "user", "content": args.prompt}])
        ids = prompt.token_ids
    else:
        ids = tok.encode(args.prompt)
    try:
        engine.add_request(ids, params)
    except ValueError as e:
        print(f"kvserve generate: {e}", file=sys.stderr)
        return 2
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.new_text:
                sys.stdout.write(delta.new_text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
