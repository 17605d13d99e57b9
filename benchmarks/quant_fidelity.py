"""Fidelity of quantized execution on the default model (a benchmark: prints, asserts nothing).

1. Q4_1 file run quantized (``quantization="auto"``: Q4_1 layers, Q8_0 tied embedding /
   lm_head, int8 activation blocks) vs the same weights dequantized to float32
   (``"none"``): next-token agreement and logit error over test prompts (prefill logits
   at every position).
2. int4 at load, symmetric (q4_0) vs zero point (q4_1), and int8: relative
   reconstruction error of the float32 (dequantized) linear weights, and the logit
   agreement of the resulting model against float32 -- the measurement behind
   ``loader.INT4_ZERO_POINT``.

Usage: ``PYTHONPATH=. python benchmarks/quant_fidelity.py``
"""

from __future__ import annotations

import torch

from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model
from kvserve.model.quant.formats import quantize_4bit, quantize_symmetric8
from kvserve.worker.model_runner import allocate_kv_cache

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + ",
    "Photosynthesis is the process by which green plants use sunlight to make food from "
    "carbon dioxide and water. The light reactions take place in the thylakoid membranes",
    "<|im_start|>user\nWhat is the capital of France, and why is it famous?<|im_end|>\n"
    "<|im_start|>assistant\n",
]


def logits(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    n, bs = len(ids), 16
    blocks = list(range(1, 2 + n // bs))
    kv = allocate_kv_cache(model, len(blocks) + 1, bs, torch.float32)
    meta = build_attention_metadata(
        [SeqSpec(0, n, n, 0, blocks)],
        num_tokens=n,
        block_size=bs,
        kv_segment_size=64,
        kv_dtype=torch.float32,
    )
    with torch.inference_mode():
        return model.compute_logits(
            model(torch.tensor(ids), torch.arange(n), list(kv.unbind(0)), meta)
        )


def compare(name: str, got_model, ref_model, tok) -> None:  # type: ignore[no-untyped-def]
    agree = total = 0
    max_err = 0.0
    mean_err = []
    last_agree = 0
    for text in PROMPTS:
        ids = tok(text * 3)["input_ids"][:200]
        g, r = logits(got_model, ids), logits(ref_model, ids)
        agree += int((g.argmax(-1) == r.argmax(-1)).sum())
        total += len(ids)
        last_agree += int(g[-1].argmax() == r[-1].argmax())
        max_err = max(max_err, (g - r).abs().max().item())
        mean_err.append((g - r).abs().mean().item())
    print(
        f"{name:<34} next-token agreement {agree / total:6.1%} ({total} positions), last "
        f"token {last_agree}/{len(PROMPTS)}, max |logit err| {max_err:.3f}, mean "
        f"{sum(mean_err) / len(mean_err):.4f}"
    )


def main() -> None:
    torch.set_num_threads(1)
    ref = load_model(DEFAULT_MODEL_NAME, dtype="float32", quantization="none")
    tok = ref.tokenizer
    q = load_model(DEFAULT_MODEL_NAME, dtype="float32", quantization="auto")
    print(f"reference: {DEFAULT_MODEL_NAME} dequantized to float32")
    compare(f"auto ({q.quantization}), fp32 act", q.model, ref.model, tok)
    qb = load_model(DEFAULT_MODEL_NAME, dtype="bfloat16", quantization="auto")
    compare(f"auto ({qb.quantization}), bf16 act", qb.model, ref.model, tok)
    nb = load_model(DEFAULT_MODEL_NAME, dtype="bfloat16", quantization="none")
    compare("none, bfloat16 (for scale)", nb.model, ref.model, tok)

    # reconstruction error per scheme. The layers are already 4-bit (Q4_1) in this file,
    # which favours q4_1 unfairly, so the matrices measured are the Q8_0 embedding (close
    # to the float original) in slices of 4096 rows
    errs: dict[str, list[float]] = {"int8 (q8_0)": [], "int4 sym (q4_0)": [], "int4 zp (q4_1)": []}
    emb = ref.model.embed_tokens.data.float()
    for start in range(0, emb.shape[0], 4096):
        w = emb[start : start + 4096]
        for key, qw in (
            ("int8 (q8_0)", quantize_symmetric8(w)),
            ("int4 sym (q4_0)", quantize_4bit(w, zero_point=False)),
            ("int4 zp (q4_1)", quantize_4bit(w, zero_point=True)),
        ):
            errs[key].append(((qw.dequantize() - w).norm() / w.norm()).item())
    for key, e in errs.items():
        print(
            f"{key:<18} relative reconstruction error of the embedding, mean over slices {sum(e) / len(e):.4f}"
        )


if __name__ == "__main__":
    main()
