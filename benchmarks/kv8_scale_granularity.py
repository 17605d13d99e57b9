"""int8 KV scale granularity on real K/V of the default model: relative RMS quantization
error with one scale per token and head (what kvserve stores) vs one per block and head.

Run: PYTHONPATH=. python benchmarks/kv8_scale_granularity.py [--quantization none]
"""

from __future__ import annotations

import argparse

import torch

from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model
from kvserve.worker.model_runner import allocate_kv_cache

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type. "
)


def rel_rms(x: torch.Tensor, amax: torch.Tensor) -> float:
    """Relative RMS error of symmetric int8 with scale ``amax / 127``."""
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = (x / s).round().clamp(-127, 127) * s
    return float(((q - x).pow(2).sum() / x.pow(2).sum()).sqrt())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(1)
    m = load_model(DEFAULT_MODEL_NAME, dtype="bfloat16", quantization=args.quantization)
    ids = m.tokenizer(TEXT * 20)["input_ids"][:256]
    assert len(ids) == 256
    bs = 16
    blocks = list(range(1, 1 + 256 // bs))
    kv = allocate_kv_cache(m.model, len(blocks) + 1, bs, torch.bfloat16)
    meta = build_attention_metadata(
        [SeqSpec(0, 256, 256, 0, blocks)],
        num_tokens=256,
        block_size=bs,
        kv_segment_size=0,
        backend="native",
        kv_dtype=torch.bfloat16,
    )
    with torch.inference_mode():
        m.model(torch.tensor(ids), torch.arange(256), list(kv.unbind(0)), meta)
    x = kv[:, :, :, 1:].float()  # [L, 2, Hk, blocks, bs, D] without the null block
    for i, name in enumerate(("K", "V")):
        xi = x[:, i]
        tok = rel_rms(xi, xi.abs().amax(-1, keepdim=True))
        blk = rel_rms(xi, xi.abs().amax((-1, -2), keepdim=True))
        print(f"{name}: relative RMS error per-token {tok:.4f}, per-block ({bs} tokens) {blk:.4f}")


if __name__ == "__main__":
    main()
