"""Multi-LoRA benchmark (issue 40), not a test: prints one JSON object for the note.

1. Output tok/s of ``--streams`` concurrent greedy streams, each on a random one of
   ``--adapters`` adapters of rank ``--rank`` or on the base model (seeded), against
   the same streams all on the base model alone (the issue's target: ratio >= 0.8).
2. TTFT of a request on a newly loaded adapter against a base request (target:
   <= 1.5x), both alone on an idle engine, fresh prompts (no prefix hit); reported
   with the load counted (``LLM.generate(lora_request=...)`` of an unseen adapter) and
   without (loaded first, then the request).

Adapters are random, built in a temporary folder (nothing downloaded). The issue's
configuration is the default; ``--tiny`` runs a correctness-sized version::

    .venv/bin/python benchmarks/lora_bench.py            # 8 adapters, rank 16, 16 streams
    .venv/bin/python benchmarks/lora_bench.py --tiny
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.lora_adapters import make_adapter  # noqa: E402

from kvserve import LLM, LoRARequest, SamplingParams  # noqa: E402


def prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def throughput(
    llm: LLM,
    choices: list[LoRARequest | None],
    prompt_ids: list[list[int]],
    max_tokens: int,
) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(
        prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=False, lora_request=choices
    )
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def ttft(llm: LLM, prompt_ids: list[int], lora: LoRARequest | None) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    llm.generate(
        prompt_token_ids=[prompt_ids], sampling_params=params, use_tqdm=False, lora_request=lora
    )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="default: kvserve's default model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ttft-prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="2 adapters, rank 4, 4 streams, 8 tokens")
    args = ap.parse_args()
    if args.tiny:
        args.adapters, args.rank, args.streams = 2, 4, 4
        args.prompt_len, args.max_tokens, args.ttft_prompt_len, args.repeats = 16, 8, 32, 1
    rng = random.Random(args.seed)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        enable_lora=True,
        max_loras=args.adapters + 2,
        max_lora_rank=args.rank,
        max_model_len=max(args.prompt_len + args.max_tokens, args.ttft_prompt_len + 1) + 16,
        max_num_seqs=max(args.streams, 1),
    )
    hf_config = llm.engine.loaded.hf_config
    with tempfile.TemporaryDirectory() as tmp:
        reqs = [
            LoRARequest(
                f"a{i}",
                i + 1,
                str(make_adapter(Path(tmp) / f"a{i}", hf_config, rank=args.rank, seed=i)),
            )
            for i in range(args.adapters)
        ]
        options: list[LoRARequest | None] = [None, *reqs]
        choices = [rng.choice(options) for _ in range(args.streams)]
        # warm-up: every adapter loaded and every path run once
        throughput(llm, options, prompts(rng, len(options), 8), 2)
        base_tps, lora_tps = [], []
        for _ in range(args.repeats):
            ids = prompts(rng, args.streams, args.prompt_len)
            base_tps.append(throughput(llm, [None] * args.streams, ids, args.max_tokens))
            ids = prompts(rng, args.streams, args.prompt_len)
            lora_tps.append(throughput(llm, choices, ids, args.max_tokens))
        base_ttft, new_ttft, new_ttft_loaded = [], [], []
        for r in range(args.repeats):
            base_ttft.append(ttft(llm, prompts(rng, 1, args.ttft_prompt_len)[0], None))
            folder = make_adapter(Path(tmp) / f"new{r}", hf_config, rank=args.rank, seed=100 + r)
            new = LoRARequest(f"new{r}", 1000 + r, str(folder))
            new_ttft.append(ttft(llm, prompts(rng, 1, args.ttft_prompt_len)[0], new))
            manager = llm.engine.lora_manager
            assert manager is not None
            manager.begin_unload(new.lora_name)
            manager.finish_unload(new.lora_name)
            t0 = time.perf_counter()
            manager.load(new.lora_name, new.lora_path)
            load_s = time.perf_counter() - t0
            new_ttft_loaded.append(ttft(llm, prompts(rng, 1, args.ttft_prompt_len)[0], new))
            manager.begin_unload(new.lora_name)
            manager.finish_unload(new.lora_name)
    med = statistics.median
    result = {
        "config": vars(args),
        "streams_on": {
            ("base" if c is None else c.lora_name): sum(1 for x in choices if x == c)
            for c in options
        },
        "base_tok_s": med(base_tps),
        "lora_mixed_tok_s": med(lora_tps),
        "tok_s_ratio": med(lora_tps) / med(base_tps),
        "base_ttft_s": med(base_ttft),
        "new_adapter_ttft_s_with_load": med(new_ttft),
        "new_adapter_ttft_s_loaded_first": med(new_ttft_loaded),
        "last_load_s": load_s,
        "ttft_ratio_with_load": med(new_ttft) / med(base_ttft),
        "ttft_ratio_loaded_first": med(new_ttft_loaded) / med(base_ttft),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
