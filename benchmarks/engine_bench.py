"""Engine benchmark (issue 5), not a test: prints figures for the issue note.

1. Time to first token of a request sharing a 1,700-token prefix with an earlier
   request, with prefix caching on and off (median of --repeats).
2. Generation throughput for N prompts of 512 tokens / 128 new tokens through
   ``LLM.generate`` vs HF transformers ``generate`` with batch 8, same prompts, same run.

    .venv/bin/python benchmarks/engine_bench.py [--num-prompts 32] [--skip-hf]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvserve import LLM, SamplingParams


def ttft_with_prefix(enable_prefix_caching: bool, repeats: int) -> float:
    llm = LLM(
        enable_prefix_caching=enable_prefix_caching, max_num_batched_tokens=512, max_model_len=4096
    )
    rng = random.Random(0)
    times = []
    for r in range(repeats):
        prefix = [rng.randrange(100, 40000) for _ in range(1700)]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate(
            prompt_token_ids=[prefix + [11, 12, 13 + r]], sampling_params=params, use_tqdm=False
        )
        out = llm.generate(
            prompt_token_ids=[prefix + [21, 22, 23 + r]], sampling_params=params, use_tqdm=False
        )[0]
        times.append(out.metrics.first_token_time - out.metrics.arrival_time)
    return statistics.median(times)


def make_prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def kvserve_throughput(prompts: list[list[int]], max_tokens: int) -> float:
    llm = LLM(max_num_batched_tokens=512, max_num_seqs=32, max_model_len=2048)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(
        prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False
    )
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def hf_throughput(prompts: list[list[int]], max_tokens: int, batch: int = 8) -> float:
    from transformers import AutoModelForCausalLM

    from kvserve.model.loader import resolve_model

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model("smollm2-135m-instruct"), dtype=torch.float32
    )
    model.eval()
    n_out = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch])  # equal lengths: no padding needed
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            n_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return n_out / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()

    on = ttft_with_prefix(True, args.repeats)
    off = ttft_with_prefix(False, args.repeats)
    print(
        f"TTFT, 1,700-token shared prefix: caching on {on * 1000:.0f} ms, off {off * 1000:.0f} ms, ratio {on / off:.3f}"
    )

    prompts = make_prompts(args.num_prompts, args.input_len)
    ours = kvserve_throughput(prompts, args.output_len)
    print(
        f"kvserve: {ours:.1f} output tok/s ({args.num_prompts} x {args.input_len} in / {args.output_len} out)"
    )
    if not args.skip_hf:
        hf = hf_throughput(prompts, args.output_len)
        print(
            f"HF transformers generate, batch 8: {hf:.1f} output tok/s; kvserve / HF = {ours / hf:.2f}x"
        )


if __name__ == "__main__":
    main()
