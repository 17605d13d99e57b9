"""``kvserve bench forward``: forward-pass speed of kvserve's model runner vs HF.

Measures, in one process and one run (medians; kvserve and HF steps interleaved so
both see the same machine load):

- prefill tok/s of one prompt of each ``--prefill-lens`` length (one step, logits for
  the last token only; HF: ``model(ids, logits_to_keep=1)`` with a KV cache);
- prefill tok/s of a chunk over a cached prefix, each ``--cached-prefill`` ``NEW@CACHED``
  (a prefix-cache hit: the prefix's KV is in the request's blocks, one step prefills
  the NEW tokens, attending to all CACHED ones; kvserve only);
- for every prefill row, the fraction of the FLOP limit it reaches: model FLOPs
  (:func:`prefill_flops`: 2 per weight per new token, the last token's LM head, and
  attention's Q.K and P.V, causal part counted once) over the FLOP/s of a large
  matmul in the model dtype on the same threads and clock (:func:`matmul_flop_s`, the
  machine's practical GEMM peak);
- decode step time at each ``--decode-batches`` size: every request has a
  ``--context``-token prompt already prefilled, then one token per request per step
  (kvserve: ``ModelRunner.execute_model`` with greedy sampling; HF: ``model(next_ids,
  cache)`` plus argmax).

- decode attention per step (all layers) at each ``--attention-batches`` ×
  ``--attention-contexts``, against the memory-bandwidth limit
  (:mod:`kvserve.bench.attention_bench`).

Both engines run in the same resolved ``--dtype`` (``auto``: bfloat16 where the CPU has
native bf16). Targets: prefill >= HF, decode batch 1 >= 2x HF tok/s, decode batch 32 >=
8x kvserve's own batch-1 tok/s. A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvserve.bench.forward_args import add_arguments
from kvserve.bench.forward_drivers import HfDriver, KvserveDriver
from kvserve.bench.forward_report import print_table

__all__ = ["add_arguments", "matmul_flop_s", "prefill_flops", "run"]


def prefill_flops(arch: Any, new: int, cached: int = 0) -> float:
    """FLOPs of prefilling ``new`` tokens over ``cached`` ones (logits of the last token):
    2 per weight per token for the layers' linears, the LM head once, and attention's
    Q.K and P.V (2 * 2 * H * D per query-key pair, ``new * cached + new^2 / 2`` pairs)."""
    h, d, hk = arch.num_heads, arch.head_dim, arch.num_kv_heads
    per_layer = arch.hidden_size * (h + 2 * hk) * d + h * d * arch.hidden_size
    per_layer += 3 * arch.hidden_size * arch.intermediate_size
    linear = 2.0 * arch.num_layers * per_layer * new + 2.0 * arch.hidden_size * arch.vocab_size
    attention = 4.0 * arch.num_layers * h * d * (new * cached + new * new / 2)
    return linear + attention


def matmul_flop_s(dtype: Any, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a ``size``-cubed matmul in ``dtype`` (median; the bench's clock and
    threads): the practical FLOP limit the prefill rows are measured against."""
    import torch

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.matmul(a, b)
    times = [_timed(functools.partial(torch.matmul, a, b)) for _ in range(repeats)]
    return 2.0 * size**3 / statistics.median(times)


_CLOCK: Callable[[], float] = time.perf_counter


def _timed(fn: Callable[[], Any]) -> float:
    t0 = _CLOCK()
    fn()
    return _CLOCK() - t0


def run(args: argparse.Namespace) -> int:
    import torch

    from kvserve.model.loader import load_model, resolve_model

    global _CLOCK
    _CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, quantization=args.quantization)
    vocab = int(loaded.hf_config.vocab_size)
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(100, vocab - 100, (n, length), generator=gen).tolist()

    max_batch = max(args.decode_batches)
    tokens_needed = max(
        max(args.prefill_lens),
        max_batch * (args.context + args.decode_steps + 4),
        max([n + c for n, c in args.cached_prefill], default=0),
    )
    num_blocks = 2 + 2 * -(-tokens_needed // args.block_size)
    kv = KvserveDriver(
        loaded, args.block_size, args.kv_segment_size, num_blocks, args.batch_invariant
    )
    # HF runs the float weights: the dequantized folder (a quantized GGUF run's own
    # folder holds no weights)
    hf_dir = loaded.model_dir if loaded.quantization == "float" else resolve_model(args.model)
    hf = None if args.no_hf else HfDriver(hf_dir, loaded.dtype)
    results: dict[str, Any] = {
        "model": args.model,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "weights": loaded.quantization,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "load_average_1m": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
        "context": args.context,
        "batch_invariant": kv.runner.batch_invariant,
        "invariant_max_context": kv.runner.invariant_max_context,
        "prefill": {},
        "cached_prefill": {},
        "decode": {},
    }
    arch = loaded.model.config
    peak = matmul_flop_s(loaded.dtype)
    results["matmul_gflop_s"] = peak / 1e9

    # the lengths' repeats round-robin (after one warm-up each), so a change of machine
    # load hits every length alike and their ratio (the 2048 / 512 line) holds up
    lens_prompts = {length: prompts(1, length) for length in args.prefill_lens}
    for p in lens_prompts.values():
        kv.prefill(p)  # warm-up
        if hf:
            hf.prefill(p)
    kv_times: dict[int, list[float]] = {length: [] for length in lens_prompts}
    hf_times: dict[int, list[float]] = {length: [] for length in lens_prompts}
    for _ in range(args.repeats):
        for length, p in lens_prompts.items():
            kv_times[length].append(_timed(functools.partial(kv.prefill, p)))
            if hf:
                hf_times[length].append(_timed(functools.partial(hf.prefill, p)))
    for length in lens_prompts:
        kv_t, hf_t = kv_times[length], hf_times[length]
        results["prefill"][length] = {
            "kvserve_tok_s": length / statistics.median(kv_t),
            "hf_tok_s": length / statistics.median(hf_t) if hf_t else None,
            "fraction_of_flop_limit": prefill_flops(arch, length) / statistics.median(kv_t) / peak,
        }

    for new_tokens, cached in args.cached_prefill:
        prompt = prompts(1, cached + new_tokens)[0]
        kv.prefill([prompt[:cached]], reserve=new_tokens)  # the prefix's KV, untimed
        blocks = next(iter(kv.live.values()))["blocks"]
        kv.prefill_cached(prompt, cached, blocks)  # warm-up
        kv_t = [
            _timed(functools.partial(kv.prefill_cached, prompt, cached, blocks))
            for _ in range(args.repeats)
        ]
        t = statistics.median(kv_t)
        results["cached_prefill"][f"{new_tokens}@{cached}"] = {
            "new_tokens": new_tokens,
            "cached_tokens": cached,
            "kvserve_tok_s": new_tokens / t,
            "fraction_of_flop_limit": prefill_flops(arch, new_tokens, cached) / t / peak,
        }

    for batch in args.decode_batches:
        p = prompts(batch, args.context)
        kv.prefill(p, reserve=args.decode_steps + 4)
        kv.decode_step()  # warm-up
        if hf:
            hf.prefill(p)
            hf.decode_step()
        kv_t, hf_t = [], []
        for _ in range(args.decode_steps):
            kv_t.append(_timed(kv.decode_step))
            if hf:
                hf_t.append(_timed(hf.decode_step))
        kv_s = statistics.median(kv_t)
        hf_s = statistics.median(hf_t) if hf_t else None
        results["decode"][batch] = {
            "kvserve_step_ms": kv_s * 1e3,
            "kvserve_tok_s": batch / kv_s,
            "hf_step_ms": hf_s * 1e3 if hf_s else None,
            "hf_tok_s": batch / hf_s if hf_s else None,
        }

    backends = [b for b in args.attention_backends.split(",") if b and b != "none"]
    if backends:
        from kvserve.bench.attention_bench import run_attention_grid

        results["attention"] = run_attention_grid(
            loaded.model.config,
            loaded.dtype,
            args.attention_batches,
            args.attention_contexts,
            backends,
            clock=_CLOCK,
            placements=[p for p in args.attention_placements.split(",") if p],
        )

    formats = [f for f in args.weight_formats.split(",") if f]
    if formats:
        from kvserve.bench.weight_formats import decode_rows, read_bandwidth_gb_s

        bw = read_bandwidth_gb_s(_CLOCK)
        rows: list[dict[str, Any]] = []
        for quant in formats:
            fmt_loaded = load_model(args.model, dtype=args.dtype, quantization=quant)
            rows += decode_rows(
                fmt_loaded,
                quant,
                lambda m: KvserveDriver(m, args.block_size, args.kv_segment_size, num_blocks),
                args.decode_batches,
                args.context,
                args.decode_steps,
                bw,
                _CLOCK,
                prompts,
            )
            del fmt_loaded
        results["weight_formats"] = {"read_bandwidth_gb_s": bw, "rows": rows}

    kv_names = [f for f in args.kv_formats.split(",") if f]
    if kv_names:
        from kvserve.bench import kv_formats
        from kvserve.bench.weight_formats import read_bandwidth_gb_s as bandwidth

        bw = bandwidth(_CLOCK)
        results["kv_formats"] = {
            "read_bandwidth_gb_s": bw,
            "attention": kv_formats.attention_rows(
                loaded.model.config,
                loaded.dtype,
                kv_names,
                args.attention_batches,
                args.attention_contexts,
                bw,
                clock=_CLOCK,
            ),
            "decode": kv_formats.decode_rows(
                loaded,
                kv_names,
                lambda m, name: KvserveDriver(
                    m, args.block_size, args.kv_segment_size, num_blocks, kv_cache_dtype=name
                ),
                args.decode_batches,
                args.context,
                args.decode_steps,
                bw,
                _CLOCK,
                prompts,
            ),
        }

    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
