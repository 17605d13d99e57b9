"""int8 KV scale granularity on real K/V of the default model: relative RMS quantization
error with one scale per token and head (what kvserve stores) vs one per block and head.

Run: PYTHONPATH=. python benchmarks/kv8_scale_granularity.py (Q=none for float weights)."""

from __future__ import annotations

import torch
from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model
from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.worker.model_runner import allocate_kv_cache
import os

QUANT = os.environ.get("Q", "auto")
torch.set_num_threads(1)
m = load_model(DEFAULT_MODEL_NAME, dtype="bfloat16", quantization=QUANT)
text = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable metal type. "
    * 20
)
ids = m.tokenizer(text)["input_ids"][:256]
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
x = kv[:, :, :, 1:].float()  # [L, 2, Hk, blocks, bs, D]


def err(amax):
    s = amax / 127
    q = (x / s).round().clamp(-127, 127) * s
    e = q - x
    return (e.pow(2).sum() / x.pow(2).sum()).sqrt().item()


tok = x.abs().amax(-1, keepdim=True)
blk = x.abs().amax((-1, -2), keepdim=True)
print("relative RMS error, K and V together: per-token", err(tok), "per-block", err(blk))
for i, name in enumerate("KV"):
    xi = x[:, i]

    def e2(amax):
        s = amax / 127
        q = (xi / s).round().clamp(-127, 127) * s
        return ((q - xi).pow(2).sum() / xi.pow(2).sum()).sqrt().item()

    print(
        name,
        "per-token",
        e2(xi.abs().amax(-1, keepdim=True)),
        "per-block",
        e2(xi.abs().amax((-1, -2), keepdim=True)),
    )
