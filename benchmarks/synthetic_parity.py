"""Greedy ids of kvserve against transformers on a synthetic model's hf-bf16 folder,
both in float32 (the folder upcast): the check that a real shape loads right.

    PYTHONPATH=. .venv/bin/python benchmarks/synthetic_parity.py --shape llama-3.2-1b

Random weights still give a deterministic argmax; EOS is ignored on both sides (HF:
a plain argmax loop, which never stops at EOS).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from kvserve import LLM, SamplingParams
    from kvserve.model.synthetic import generate

    folder = generate(a.shape, "hf-bf16")
    prompts = [
        [1 + (i * 7919 + j * 104729) % 49000 for j in range(a.prompt_len)] for i in range(a.prompts)
    ]
    t0 = time.monotonic()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out: list[int] = []
            past = None
            x = ids
            for _ in range(a.max_tokens):
                r = hf(input_ids=x, past_key_values=past, use_cache=True)
                past = r.past_key_values
                nxt = int(r.logits[0, -1].argmax())
                out.append(nxt)
                x = torch.tensor([[nxt]])
            want.append(out)
    t_hf = time.monotonic() - t0
    del hf
    t0 = time.monotonic()
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=256, max_model_len=1024,
              max_step_ms=0)  # fmt: skip
    got = [
        list(o.outputs[0].token_ids)
        for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True),
        )
    ]
    t_kv = time.monotonic() - t0
    same = sum(g == w for g, w in zip(got, want, strict=True))
    print(json.dumps({"shape": a.shape, "prompts": len(prompts), "identical": same,
                      "hf_s": round(t_hf, 1), "kvserve_s": round(t_kv, 1),
                      "first": {"hf": want[0], "kvserve": got[0]}}))  # fmt: skip
    if same != len(prompts):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
