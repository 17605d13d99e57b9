"""HF transformers greedy references for the parity tests, batched.

A float32 135M model reads ~0.5 GB of weights per decode step, so one prompt at a time
costs ~65 ms a token on these cores (the LoRA parity of 20 prompts x 12 tokens took 17 s
per adapter); one left-padded batch reads them once per step for every row (2.3 s).
"""

from __future__ import annotations

from typing import Any

import torch


def hf_greedy_batch(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids), ``max_new_tokens`` each, as
    kvserve's ``ignore_eos``: EOS may be chosen and does not stop a row (HF's
    ``min_new_tokens`` would mask it instead). Rows come back in the prompts' order.

    Prompts of similar length (within 1.25x + 16 tokens of the shortest in the group)
    run as one left-padded batch with an attention mask (HF derives the positions from
    it), so every row sees exactly its own tokens and padding costs little prefill.
    Padding changes the matmul shapes, not what is computed: on the suite's prompts the
    rows equal the one-prompt-at-a-time references token for token (checked for the
    LoRA parity's 60 rows and the engine and model HF-parity prompts when this was
    written); a near-tie between two logits is the only way they could part. The
    model's generation config is restored afterwards (the session's HF model is
    shared)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups and len(prompts[i]) <= 1.25 * len(prompts[groups[-1][0]]) + 16:
            groups[-1].append(i)
        else:
            groups.append([i])
    rows: dict[int, list[int]] = {}
    for group in groups:
        for i, row in zip(
            group, _padded_greedy(model, [prompts[i] for i in group], max_new_tokens), strict=True
        ):
            rows[i] = row
    return [rows[i] for i in range(len(prompts))]


def _padded_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    gen = model.generation_config
    eos = gen.eos_token_id
    gen.eos_token_id = None
    try:
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    finally:
        gen.eos_token_id = eos
    rows = out[:, longest:].tolist()
    assert all(len(r) == max_new_tokens for r in rows)
    return rows
