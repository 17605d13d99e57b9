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

from kvserve.bench.forward_drivers import HfDriver, KvserveDriver


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid list {text!r}: give comma-separated integers (e.g. 1,8,32)"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: integers >= 1 (e.g. 1,8,32)")
    return values


def _cached_list(text: str) -> list[tuple[int, int]]:
    """``512@2048,256@4096`` -> [(512, 2048), (256, 4096)] (new tokens, cached tokens)."""
    if text.strip() == "none":
        return []
    out = []
    for item in text.split(","):
        new, _, cached = item.strip().partition("@")
        try:
            pair = (int(new), int(cached))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid chunk {item!r}: give NEW@CACHED token counts (e.g. 512@2048)"
            ) from None
        if pair[0] < 2 or pair[1] < 1:
            raise argparse.ArgumentTypeError(
                f"invalid chunk {item!r}: NEW >= 2 and CACHED >= 1 (e.g. 512@2048)"
            )
        out.append(pair)
    return out


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="model (default: %(default)s)"
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto (default), float32, bfloat16 or float16"
    )
    parser.add_argument(
        "--prefill-lens",
        type=_int_list,
        default=[512, 2048, 4096],
        help="prompt lengths (default: 512,2048,4096)",
    )
    parser.add_argument(
        "--cached-prefill",
        type=_cached_list,
        default=[(512, 2048), (512, 4096)],
        help="chunks over a cached prefix, NEW@CACHED comma-separated, or none "
        "(default: 512@2048,512@4096)",
    )
    parser.add_argument(
        "--decode-batches",
        type=_int_list,
        default=[1, 8, 32, 64],
        help="decode batch sizes (default: 1,8,32,64)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=128,
        help="prompt tokens per decode request (default: %(default)s)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=12,
        help="timed decode steps per batch size (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed prefills per length (default: %(default)s)"
    )
    parser.add_argument(
        "--kv-segment-size", type=int, default=512, help="prefill KV segment (default: %(default)s)"
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="KV block size (default: %(default)s)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time, robust to other load on a "
        "shared machine when used with --threads 1 (default: %(default)s)",
    )
    parser.add_argument(
        "--attention-batches",
        type=_int_list,
        default=[1, 16, 64],
        help="decode attention grid: batch sizes (default: 1,16,64)",
    )
    parser.add_argument(
        "--attention-contexts",
        type=_int_list,
        default=[1024, 4096],
        help="decode attention grid: contexts (default: 1024,4096)",
    )
    parser.add_argument(
        "--attention-backends",
        default="native",
        help="decode attention grid: comma-separated native,portable, or none to skip "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        help="weights of the main run: auto (default: a GGUF's quantized tensors as they "
        "are), none, int8 or int4",
    )
    parser.add_argument(
        "--weight-formats",
        default="",
        help="also decode at --decode-batches with each of these comma-separated "
        "quantization values (e.g. none,auto), against the memory-bandwidth limit",
    )
    parser.add_argument(
        "--kv-formats",
        default="",
        help="also time decode attention (--attention-batches x --attention-contexts, "
        "interleaved) and whole-model decode (--decode-batches) with each of these "
        "comma-separated KV cache dtypes (e.g. auto,int8,fp8_e4m3), against the "
        "memory-bandwidth limit",
    )
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batch-invariant kernels on/off (default: the engine's automatic choice)",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


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

    for length in args.prefill_lens:
        p = prompts(1, length)
        kv.prefill(p)  # warm-up
        if hf:
            hf.prefill(p)
        kv_t, hf_t = [], []
        for _ in range(args.repeats):
            kv_t.append(_timed(functools.partial(kv.prefill, p)))
            if hf:
                hf_t.append(_timed(functools.partial(hf.prefill, p)))
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

    _print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _print_table(r: dict[str, Any]) -> None:
    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:6.2f}x" if a and b else "     -"

    def num(x: float | None, fmt: str) -> str:
        return format(x, fmt) if x is not None else "-"

    print(
        f"kvserve bench forward: model={r['model']} dtype={r['dtype']} weights={r['weights']} "
        f"threads={r['threads']} "
        f"clock={r['clock']} (medians)"
    )
    print(f"{'measure':<28}{'kvserve':>12}{'HF':>12}{'kv/HF':>9}{'of FLOP limit':>15}")
    for length, v in r["prefill"].items():
        print(
            f"{f'prefill {length} tok/s':<28}{v['kvserve_tok_s']:>12.0f}"
            f"{num(v['hf_tok_s'], '.0f'):>12}{ratio(v['kvserve_tok_s'], v['hf_tok_s']):>9}"
            f"{v['fraction_of_flop_limit']:>15.0%}"
        )
    for key, v in r.get("cached_prefill", {}).items():
        print(
            f"{f'prefill {key} tok/s':<28}{v['kvserve_tok_s']:>12.0f}{'-':>12}{'-':>9}"
            f"{v['fraction_of_flop_limit']:>15.0%}"
        )
    lens = r["prefill"]
    if lens and 512 in lens and 2048 in lens:
        rel = lens[2048]["kvserve_tok_s"] / lens[512]["kvserve_tok_s"]
        print(f"kvserve prefill tok/s, 2048 / 512 tokens: {rel:.2f}x (target >= 0.8x)")
    if "matmul_gflop_s" in r:
        print(
            f"FLOP limit: {r['matmul_gflop_s']:.0f} GFLOP/s, a 2048^3 {r['dtype']} matmul "
            "measured here (same threads and clock); prefill NEW@CACHED: NEW tokens after "
            "CACHED cached ones"
        )
    for batch, v in r["decode"].items():
        print(
            f"{f'decode b={batch} step ms':<28}{v['kvserve_step_ms']:>12.1f}"
            f"{num(v['hf_step_ms'], '.1f'):>12}{ratio(v['hf_step_ms'], v['kvserve_step_ms']):>9}"
        )
        print(
            f"{f'decode b={batch} tok/s':<28}{v['kvserve_tok_s']:>12.1f}"
            f"{num(v['hf_tok_s'], '.1f'):>12}{ratio(v['kvserve_tok_s'], v['hf_tok_s']):>9}"
        )
    dec = r["decode"]
    if 1 in dec and 32 in dec:
        scale = dec[32]["kvserve_tok_s"] / dec[1]["kvserve_tok_s"]
        print(f"kvserve decode tok/s, batch 32 / batch 1: {scale:.1f}x (target >= 8x)")
    print(f"decode context: {r['context']} prompt tokens per request")
    if "weight_formats" in r:
        from kvserve.bench.weight_formats import print_rows

        print_rows(r["weight_formats"]["rows"], r["weight_formats"]["read_bandwidth_gb_s"])
    if "kv_formats" in r:
        from kvserve.bench.kv_formats import print_rows as print_kv_rows

        print_kv_rows(r["kv_formats"])
    if "attention" in r:
        from kvserve.bench.attention_bench import print_attention_table

        print_attention_table(r["attention"])
    print(
        f"machine: {r['cpu_count']} CPUs, 1-minute load average {r['load_average_1m']:.1f} at "
        "start (on a busy machine use --threads 1 --clock cpu for stable figures)"
    )
