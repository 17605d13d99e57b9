"""Write a speculative-decoding workload as the bench client's JSONL.

``kvserve bench`` generates the workloads where proposals pay (``spec-edit``,
``spec-code``, ``spec-json``; see ``kvserve/bench/spec_workloads.py``); this writes one
of them as ``{"prompt", "output_tokens"}`` lines, the prompt already in the default
model's chat format, so vLLM's bench client (``--dataset-name custom
--skip-chat-template``) sends the same text to kvserve and to llama.cpp's server::

    python benchmarks/peers/spec_jsonl.py spec-edit 8 200 128 > /tmp/spec_edit.jsonl
    python benchmarks/peers/peers.py run kvserve:bfloat16 --workloads custom \\
        --custom /tmp/spec_edit.jsonl --rate inf --concurrency 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from kvserve.bench.spec_workloads import SPEC_KINDS, build_spec_sessions


def chat_prompt(text: str) -> str:
    """SmolLM2-Instruct's chat format (its template with no system prompt given)."""
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=[k for k in SPEC_KINDS if k != "spec-quote"])
    ap.add_argument("num_requests", type=int)
    ap.add_argument("input_len", type=int, help="approximate prompt words")
    ap.add_argument("output_len", type=int, help="output tokens per request")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    sessions = build_spec_sessions(
        a.kind, a.num_requests, a.input_len, a.output_len, 1, random.Random(a.seed)
    )
    for s in sessions:
        turn = s.turns[0]
        line = {"prompt": chat_prompt(turn.user_text), "output_tokens": a.output_len}
        sys.stdout.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
