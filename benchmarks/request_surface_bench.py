"""Request-surface benchmark (issue 13), not a test: prints the figures for the note.

1. ``n=8`` against ``n=1`` on a 1,500-token prompt: time until *every* sample has
   its first token (median of --repeats, a fresh prompt each time, so no prefix-cache
   hit), the tokens the prompt step computed, and KV blocks in use right after the
   fork and at the end, against the prompt's blocks + 8 x the output blocks.
2. Structured outputs (a JSON schema) against unconstrained sampling on the same
   prompts and the same number of output tokens per request: output tokens per
   second, batch of --batch requests, median of --repeats.
3. Prompt logprobs (fp32) against HF transformers fp32: the largest absolute error,
   cold and after a prefix-cache hit on the same prompt.

    .venv/bin/python benchmarks/request_surface_bench.py [--repeats 5] [--skip-hf]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from kvserve import LLM, SamplingParams
from kvserve.kv_cache.manager import cdiv
from kvserve.structured.params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


class _CountingRunner:
    """The model runner, counting the tokens each step computes."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.num_tokens = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def execute_model(self, so: Any) -> Any:
        self.num_tokens += so.total_num_scheduled_tokens
        return self.runner.execute_model(so)


def fan_out(llm: LLM, n: int, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One request with ``n`` samples, stepped by hand: time until all samples have a
    token, tokens computed until then, KV blocks right then and at the peak."""
    engine = llm.engine
    kv = engine.kv_cache_manager
    counting = _CountingRunner(engine.runner)
    engine.runner = counting
    params = SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=max_tokens, ignore_eos=True)
    have_token: set[str] = set()
    out = {
        "ttft_s": 0.0,
        "ttft_cpu_s": 0.0,
        "tokens_to_first": 0.0,
        "blocks_after_fork": 0.0,
        "blocks_peak": 0.0,
    }
    try:
        t0 = time.perf_counter()
        c0 = time.process_time()  # CPU time of all threads: the work, whatever the load
        engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if delta.new_token_ids:
                    have_token.add(delta.request_id)
            if len(have_token) == n and not out["ttft_s"]:
                out["ttft_s"] = time.perf_counter() - t0
                out["ttft_cpu_s"] = time.process_time() - c0
                out["tokens_to_first"] = counting.num_tokens
                out["blocks_after_fork"] = kv.num_active_blocks
            out["blocks_peak"] = max(out["blocks_peak"], kv.num_active_blocks)
    finally:
        engine.runner = counting.runner
    return out


def bench_fan_out(repeats: int, prompt_len: int, max_tokens: int) -> None:
    llm = LLM(max_model_len=2048, max_num_batched_tokens=2048, num_kv_blocks=1024, max_num_seqs=16)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
    fan_out(llm, 1, prompt, 2)  # warm-up
    results: dict[int, list[dict[str, float]]] = {1: [], 8: []}
    for r in range(repeats):
        for n in (1, 8):
            prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
            results[n].append(fan_out(llm, n, prompt, max_tokens))
        a, b = results[1][-1], results[8][-1]
        print(
            f"  repeat {r}: TTFT n=1 {a['ttft_s'] * 1e3:.0f} ms (CPU {a['ttft_cpu_s'] * 1e3:.0f}), "
            f"n=8 all samples {b['ttft_s'] * 1e3:.0f} ms (CPU {b['ttft_cpu_s'] * 1e3:.0f})",
            flush=True,
        )
    med = {n: statistics.median(x["ttft_s"] for x in rs) for n, rs in results.items()}
    ratios = [b["ttft_s"] / a["ttft_s"] for a, b in zip(results[1], results[8], strict=True)]
    bs = llm.engine.kv_cache_manager.block_size
    full, partial = divmod(prompt_len, bs)
    out_blocks = cdiv(prompt_len + max_tokens - 1, bs) - full  # a sample's own blocks
    print(f"\n1. n=8 vs n=1, {prompt_len}-token prompt, dtype {llm.engine.loaded.dtype_name}")
    print(f"   TTFT median: n=1 {med[1] * 1e3:.0f} ms, n=8 all samples {med[8] * 1e3:.0f} ms")
    print(
        f"   ratio n=8/n=1: median {statistics.median(ratios):.3f} (per repeat {[round(x, 3) for x in ratios]})"
    )
    print(
        f"   tokens computed until every sample had a token: n=1 "
        f"{results[1][0]['tokens_to_first']:.0f}, n=8 {results[8][0]['tokens_to_first']:.0f}"
    )
    print(
        f"   KV blocks after the prompt step: n=1 {results[1][0]['blocks_after_fork']:.0f}, "
        f"n=8 {results[8][0]['blocks_after_fork']:.0f} (= {full} shared full blocks + 8 x "
        f"{int(partial > 0)} partial copies)"
    )
    print(
        f"   KV blocks at the end ({max_tokens} tokens each): n=8 peak "
        f"{results[8][0]['blocks_peak']:.0f} vs prompt + 8 x output = {full} + 8 x {out_blocks} "
        f"= {full + 8 * out_blocks}; 8 separate requests would hold {8 * (full + out_blocks)}"
    )


def bench_structured(repeats: int, batch: int) -> None:
    llm = LLM(max_model_len=1024, max_num_seqs=32)
    topics = [
        "a sailor",
        "a baker",
        "a pilot",
        "a painter",
        "a chemist",
        "a farmer",
        "a judge",
        "a poet",
    ]
    convs = [
        [
            {
                "role": "user",
                "content": f"Describe {topics[i % len(topics)]} as JSON with name, age, city and hobbies.",
            }
        ]
        for i in range(batch)
    ]
    constrained = SamplingParams(
        temperature=0.7,
        seed=3,
        max_tokens=200,
        structured_outputs=StructuredOutputsParams(json=PERSON),
    )
    llm.chat(convs[:2], constrained, use_tqdm=False)  # warm-up (compiles the schema once)
    rates: dict[str, list[float]] = {"structured": [], "unconstrained": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.chat(convs, constrained, use_tqdm=False)
        dt = time.perf_counter() - t0
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        rates["structured"].append(sum(lengths) / dt)
        free = [
            SamplingParams(temperature=0.7, seed=3, max_tokens=n, ignore_eos=True) for n in lengths
        ]
        t0 = time.perf_counter()
        outs_free = llm.chat(convs, free, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert [len(o.outputs[0].token_ids) for o in outs_free] == lengths
        rates["unconstrained"].append(sum(lengths) / dt)
    s, u = statistics.median(rates["structured"]), statistics.median(rates["unconstrained"])
    per = [a / b for a, b in zip(rates["structured"], rates["unconstrained"], strict=True)]
    print(f"\n2. structured outputs (JSON schema), batch {batch}, same prompts and lengths")
    print(f"   output tok/s median: structured {s:.1f}, unconstrained {u:.1f}, ratio {s / u:.3f}")
    print(f"   per repeat ratios {[round(x, 3) for x in per]}")


def bench_prompt_logprobs() -> None:
    from transformers import AutoModelForCausalLM

    from kvserve.model.loader import DEFAULT_MODEL_NAME, resolve_model

    llm = LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=128)
    hf = AutoModelForCausalLM.from_pretrained(
        resolve_model(DEFAULT_MODEL_NAME), dtype=torch.float32
    ).eval()
    text = " ".join(
        f"Entry {i}: the lantern at the harbour was checked and found steady." for i in range(30)
    )
    ids = llm.tokenizer.encode(text)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want = torch.tensor([ref[p - 1, ids[p]].item() for p in range(1, len(ids))])
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)
    print(f"\n3. prompt logprobs vs HF fp32, {len(ids)}-token prompt in 128-token chunks")
    for label in ("cold", "after a prefix-cache hit on the same prompt"):
        if label.startswith("after"):
            llm.generate(
                prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False
            )
        out = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0]
        got = torch.tensor([lp.sampled_logprob for lp in out.prompt_logprobs[1:]])  # type: ignore[index,union-attr]
        print(
            f"   {label}: max |error| {float((got - want).abs().max()):.2e} "
            f"(cached tokens used: {out.num_cached_tokens})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--only", choices=["fanout", "structured", "logprobs"], default=None)
    args = parser.parse_args()
    if args.only in (None, "fanout"):
        bench_fan_out(args.repeats, args.prompt_len, args.max_tokens)
    if args.only in (None, "structured"):
        bench_structured(args.repeats, args.batch)
    if args.only in (None, "logprobs") and not args.skip_hf:
        bench_prompt_logprobs()


if __name__ == "__main__":
    main()
