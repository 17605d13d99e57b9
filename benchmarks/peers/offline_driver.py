"""One engine's half of ``peers.py offline``: the same prompts through an engine's offline
API, batched and one at a time, one JSON line out.

Started by ``peers.py`` in the engine's own venv (OpenVINO GenAI in the harness's
``openvino-venv``, kvserve in the project's ``.venv``)::

    python offline_driver.py openvino PROMPTS.json --model IR_DIR
    python offline_driver.py kvserve PROMPTS.json --option quantization=auto

``PROMPTS.json`` is ``{"batch": [texts], "single": [texts], "max_tokens": N,
"max_num_seqs": S, "max_num_batched_tokens": T}``. Both engines tokenize the texts with
their own tokenizer (the same Hugging Face tokenizer: OpenVINO's is converted from it)
and report the prompt token totals, so a caller can check they agree. Generation is
greedy with EOS ignored, so every request makes exactly ``max_tokens`` tokens; the driver
checks that from the returned ids. Workload ``batch``: all batch prompts submitted at once
(``max_num_seqs`` at a time), after a two-prompt warm-up; ``single``: each single prompt
alone, request time including its prefill. Only the standard library is imported at
module level (the parsing is tested without either engine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULT_KEYS = (
    "engine",
    "format",
    "batch_prompts",
    "batch_prompt_tokens",
    "batch_output_tokens",
    "batch_s",
    "batch_tok_s",
    "single_prompts",
    "single_prompt_tokens",
    "single_median_s",
    "single_tok_s",
)

# generate(list of prompt-id lists) -> list of generated-id lists
Generate = Callable[[list[list[int]]], list[list[int]]]


def parse_result(line: str) -> dict[str, Any]:
    """One driver output line -> its result dict; ValueError when it is not one (missing
    keys, or a workload's rate that is not a positive number)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not a driver result line: {line[:80]!r}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"not a driver result line: {line[:80]!r}")
    missing = [k for k in RESULT_KEYS if k not in obj]
    if missing:
        raise ValueError(f"driver result lacks {missing}")
    for k in ("batch_tok_s", "single_tok_s"):
        if obj[k] is not None and not (isinstance(obj[k], int | float) and obj[k] > 0):
            raise ValueError(f"driver result {k}={obj[k]!r} is not a positive rate")
    return obj


def last_result(stdout: str) -> dict[str, Any]:
    """The result line among a driver's stdout (engines log to stdout too)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{") and '"engine"' in line:
            return parse_result(line)
    raise ValueError("the driver printed no result line")


def measure(
    generate: Generate,
    encode: Callable[[str], list[int]],
    data: dict[str, Any],
    engine: str,
    fmt: str,
) -> dict[str, Any]:
    """Run the workloads on one engine through ``generate`` (see the module doc)."""
    n = int(data["max_tokens"])
    batch = [encode(t) for t in data["batch"]]
    single = [encode(t) for t in data["single"]]

    def checked(prompts: list[list[int]]) -> int:
        outs = generate(prompts)
        if len(outs) != len(prompts) or any(len(o) != n for o in outs):
            raise RuntimeError(
                f"{engine}: expected {len(prompts)} outputs of {n} tokens, got "
                f"{[len(o) for o in outs]}"
            )
        return sum(len(o) for o in outs)

    result: dict[str, Any] = {"engine": engine, "format": fmt}
    result.update(batch_prompts=len(batch), batch_prompt_tokens=sum(map(len, batch)))
    result.update(single_prompts=len(single), single_prompt_tokens=sum(map(len, single)))
    warm = batch[:2] or single[:1]
    if warm:
        checked(warm)
    result.update(batch_output_tokens=0, batch_s=None, batch_tok_s=None)
    if batch:
        t0 = time.perf_counter()
        toks = checked(batch)
        dt = time.perf_counter() - t0
        result.update(
            batch_output_tokens=toks, batch_s=round(dt, 3), batch_tok_s=round(toks / dt, 1)
        )
    result.update(single_median_s=None, single_tok_s=None)
    if single:
        times = []
        for p in single:
            t1 = time.perf_counter()
            checked([p])
            times.append(time.perf_counter() - t1)
        med = statistics.median(times)
        result.update(single_median_s=round(med, 4), single_tok_s=round(n / med, 1))
    return result


def openvino_engine(
    model: str, data: dict[str, Any]
) -> tuple[Generate, Callable[[str], list[int]]]:
    """OpenVINO GenAI's ContinuousBatchingPipeline on an exported IR folder, its scheduler
    sized like kvserve's (``max_num_seqs``, ``max_num_batched_tokens``), prefix caching on."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    sc = ov_genai.SchedulerConfig()
    sc.max_num_batched_tokens = int(data["max_num_batched_tokens"])
    sc.max_num_seqs = int(data["max_num_seqs"])
    sc.cache_size = 2  # GB of KV cache
    sc.enable_prefix_caching = True
    pipe = ov_genai.ContinuousBatchingPipeline(model, sc, "CPU")
    tok = pipe.get_tokenizer()
    gc = ov_genai.GenerationConfig()
    gc.max_new_tokens = int(data["max_tokens"])
    gc.ignore_eos = True
    gc.do_sample = False

    def encode(text: str) -> list[int]:
        ids = tok.encode([text], add_special_tokens=False).input_ids.data
        return [int(x) for x in ids[0]]

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        tensors = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
        res = pipe.generate(tensors, [gc] * len(prompts))
        return [list(r.m_generation_ids[0]) for r in res]

    return generate, encode


def kvserve_engine(
    options: dict[str, Any], data: dict[str, Any]
) -> tuple[Generate, Callable[[str], list[int]]]:
    """kvserve's LLM on the default model with the same scheduler limits."""
    from kvserve import LLM, SamplingParams

    llm = LLM(
        max_num_seqs=int(data["max_num_seqs"]),
        max_num_batched_tokens=int(data["max_num_batched_tokens"]),
        **options,
    )
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=int(data["max_tokens"]), temperature=0.0, ignore_eos=True)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text))

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, encode


def main(argv: list[str] | None = None) -> int:
    from kvserve_greedy import parse_options

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", choices=("openvino", "kvserve"))
    ap.add_argument("prompts", type=Path)
    ap.add_argument("--model", help="openvino: the exported IR folder")
    ap.add_argument("--format", default="", help="the label of this run's weight format")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args(argv)
    data = json.loads(args.prompts.read_text())
    if args.engine == "openvino":
        if not args.model:
            ap.error("openvino needs --model IR_DIR")
        generate, encode = openvino_engine(args.model, data)
    else:
        generate, encode = kvserve_engine(parse_options(args.option), data)
    print(json.dumps(measure(generate, encode, data, args.engine, args.format)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
