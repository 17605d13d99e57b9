"""The table ``kvserve bench forward`` prints (:mod:`kvserve.bench.forward`)."""

from __future__ import annotations

from typing import Any


def print_table(r: dict[str, Any]) -> None:
    """Print the results of :func:`kvserve.bench.forward.run` as a table (``r`` is the
    dict that run writes with ``--json``; optional sections are printed when present)."""

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
