"""Interleaved A/B of two builds of csrc/attention_kv8.cpp against bf16 paged attention.

Decode attention of 16 requests (all 30 layers of the default model's shape: 9 q heads,
3 KV heads, head_dim 64, 16-token blocks scattered at random, caches on huge pages as
the engine allocates them, layers cycling through up to 512 MB of caches), one round
of every variant at a time, CPU time. Build each side standalone, e.g.::

    g++ -O3 -march=native -fopenmp -shared -fPIC -std=c++17 -I$SRC/kvserve/model/csrc \
        $SRC/kvserve/model/csrc/attention_kv8.cpp -o /tmp/kv8ab/main.so

then ``KV8_A=/tmp/kv8ab/main.so KV8_B=/tmp/kv8ab/new.so python
benchmarks/kv8_attention_ab.py 4096,512 5 [threads]``. A benchmark: nothing asserts.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from kvserve.model.attention import SeqSpec, build_attention_metadata, paged_attention
from kvserve.model.hugepages import zeros_hugepages
from kvserve.model.kernels.kv8 import KV8Kernel, quantize_cache

torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
libs = {"main": KV8Kernel(os.environ["KV8_A"]), "new": KV8Kernel(os.environ["KV8_B"])}
batch = 16
contexts = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4096").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
hk, h, d, layers, bs = 3, 9, 64, 30, 16
clock = time.process_time
for context in contexts:
    per_req = -(-(context + 1) // bs)
    nb = 1 + batch * per_req
    free = list(range(1, nb))
    random.Random(0).shuffle(free)
    specs = [SeqSpec(i, 1, 1, context, [free.pop() for _ in range(per_req)]) for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, h, d, generator=gen).bfloat16()
    k = torch.randn(batch, hk, d, generator=gen).bfloat16()
    v = torch.randn(batch, hk, d, generator=gen).bfloat16()
    span = 512 << 20
    setups = []
    for name in ["bf16", "int8", "fp8"]:
        dt = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.uint8}[name]
        rowb = 2 * d if name == "bf16" else d + 4
        n = max(1, min(layers, span // (2 * hk * nb * bs * rowb)))
        meta = build_attention_metadata(
            specs,
            num_tokens=batch,
            block_size=bs,
            kv_segment_size=512,
            backend="native",
            kv_dtype=torch.bfloat16,
            kv_8bit=name != "bf16",
        )
        caches = []
        for _ in range(n):
            x = torch.randn((2, hk, nb, bs, d), generator=gen)
            src = x.bfloat16() if name == "bf16" else quantize_cache(x, dt)
            caches.append(zeros_hugepages(*src.shape, dtype=src.dtype).copy_(src))
        setups.append((name, caches, meta))

    def step(lib, caches, meta, q=q, k=k, v=v):  # noqa: B008
        for layer in range(layers):
            c = caches[layer % len(caches)]
            if lib is None:
                paged_attention(q, k, v, c, meta, d**-0.5)
            else:
                lib.write(k, v, c, meta.slot_mapping)
                lib.attention(q, c, meta.native.seqs, meta.native.block_tables, 512, d**-0.5)

    variants: list[tuple[str, Any, Any]] = [("bf16", None, setups[0])]
    for fmt_i, fmt in ((1, "int8"), (2, "fp8")):
        for ln in libs:
            variants.append((f"{fmt}-{ln}", libs[ln], setups[fmt_i]))
    times: dict[str, list[float]] = {vn: [] for vn, _, _ in variants}
    with torch.inference_mode():
        for _vn, lib, (_, c, m) in variants:
            step(lib, c, m)
        for _ in range(rounds):
            for vn, lib, (_, c, m) in variants:
                t0 = clock()
                step(lib, c, m)
                times[vn].append(clock() - t0)
    base = statistics.median(times["bf16"])
    for vn in times:
        med = statistics.median(times[vn])
        print(f"ctx {context:5d} {vn:10s} {med * 1e3:8.2f} ms  vs bf16 {base / med:5.2f}x")
