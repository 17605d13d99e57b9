"""kvserve's half of ``peers.py agree``: greedy ids for given prompt ids, offline.

Runs under the project's venv (``peers.py`` starts it there)::

    .venv/bin/python benchmarks/peers/kvserve_greedy.py IN.json OUT.json \\
        --model FILE.gguf --option quantization=auto --option dtype=float32

``IN.json`` is ``{"texts": [...], "prompt_token_ids": [[...]], "max_tokens": N}``; the
output is ``{"tokenized": [[...]], "outputs": [[...]], "options": {...}}``: kvserve's own
tokenization of each text (for the tokenization check) and the ids it generated from the
given ``prompt_token_ids`` (``null``: from its own tokenization; greedy, EOS ignored, exactly ``max_tokens`` each).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_options(specs: list[str]) -> dict[str, object]:
    """``NAME=VALUE`` pairs to LLM keywords; ints, floats, true/false are converted."""
    out: dict[str, object] = {}
    for spec in specs:
        name, eq, raw = spec.partition("=")
        if not eq or not name:
            raise SystemExit(f"--option {spec!r}: use NAME=VALUE, e.g. quantization=none")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    pass
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inp", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args(argv)
    options = parse_options(args.option)
    data = json.loads(args.inp.read_text())

    from kvserve import LLM, SamplingParams

    llm = LLM(args.model, **options)
    tok = llm.get_tokenizer()
    tokenized = [list(tok.encode(t)) for t in data["texts"]]
    sp = SamplingParams(max_tokens=int(data["max_tokens"]), temperature=0.0, ignore_eos=True)
    prompt_ids = data.get("prompt_token_ids") or tokenized
    outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=sp, use_tqdm=False)
    result = {
        "options": options,
        "tokenized": tokenized,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
