"""bfloat16 fidelity against HF transformers in float32 (issue 10 item 2), not a test.

For each prompt, kvserve's model in bfloat16 (KV cache in bf16, native attention where
it builds) prefills the prompt; its logits at every position are compared with HF
transformers' float32 logits on the same weights: next-token (argmax) agreement at
the last position ("first token") and over all positions, and the max / mean absolute
logit error. Then a greedy continuation of ``--new-tokens`` through ``LLM.generate``
in bf16 is compared with HF float32 greedy.

    .venv/bin/python benchmarks/bf16_fidelity.py [--new-tokens 32]
"""

from __future__ import annotations

import argparse

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model, resolve_model
from kvserve.worker.model_runner import allocate_kv_cache

TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. " * 6,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Q: What is the capital of France?\nA:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three laws of thermodynamics state that",
    "Translate to French: 'The weather is nice today.'\nFrench:",
]


def kvserve_logits(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
    n = len(ids)
    blocks = list(range(1, 2 + n // block_size))
    kv = allocate_kv_cache(model, len(blocks) + 1, block_size, model.embed_tokens.dtype)
    meta = build_attention_metadata(
        [SeqSpec(0, n, n, 0, blocks)],
        num_tokens=n,
        block_size=block_size,
        kv_segment_size=512,
        kv_dtype=model.embed_tokens.dtype,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), list(kv.unbind(0)), meta)
        return model.compute_logits(hidden)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    bf16 = load_model(DEFAULT_MODEL_NAME, dtype="bfloat16", quantization="none")
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(DEFAULT_MODEL_NAME)).eval()
    tok = bf16.tokenizer
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    first_ok = pos_ok = pos_total = 0
    max_err = 0.0
    mean_errs = []
    for ids in prompts:
        got = kvserve_logits(bf16.model, ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        err = (got - ref).abs()
        max_err = max(max_err, float(err.max()))
        mean_errs.append(float(err.mean()))
        agree = got.argmax(-1) == ref.argmax(-1)
        first_ok += int(agree[-1])
        pos_ok += int(agree.sum())
        pos_total += len(ids)
    print(
        f"prompts: {len(prompts)} ({pos_total} positions), logits range ~{float(ref.abs().max()):.0f}"
    )
    print(f"first-token agreement (bf16 vs HF fp32): {first_ok}/{len(prompts)}")
    print(
        f"next-token agreement over all positions: {pos_ok}/{pos_total} = {pos_ok / pos_total:.1%}"
    )
    print(
        f"max |logit error|: {max_err:.3f}; mean |logit error|: {sum(mean_errs) / len(mean_errs):.4f}"
    )

    llm = LLM(dtype="bfloat16", quantization="none", max_model_len=2048)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    same_tokens = total = identical = 0
    for ids, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=0,
                min_new_tokens=args.new_tokens,
            )[0, len(ids) :].tolist()
        mine = out.outputs[0].token_ids
        prefix = next(
            (i for i, (a, b) in enumerate(zip(mine, ref, strict=False)) if a != b), len(ref)
        )
        same_tokens += prefix
        total += len(ref)
        identical += int(mine == ref)
    print(
        f"greedy {args.new_tokens} tokens: {identical}/{len(prompts)} continuations identical; "
        f"{same_tokens}/{total} tokens before the first divergence"
    )


if __name__ == "__main__":
    main()
