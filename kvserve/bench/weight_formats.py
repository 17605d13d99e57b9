"""Decode speed per weight format against the memory-bandwidth limit
(``kvserve bench forward --weight-formats none,auto``).

A decode step reads every weight once and each request's KV once, so its floor is
``(weight bytes + KV bytes read) / read bandwidth``. ``fraction_of_bandwidth`` is that
floor over the measured step time: 1.0 means the step streams memory as fast as a plain
``sum`` over a large tensor does. Weight bytes are the resident copies the model's
kernels read (:meth:`LlamaForCausalLM.weight_bytes` counts every copy, so for float
weights with a second packed copy the true per-step traffic is smaller: the column
``stream MB`` counts one copy, the one a decode step reads).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


def read_bandwidth_gb_s(
    clock: Callable[[], float], num_bytes: int = 512 << 20, repeats: int = 7
) -> float:
    """Read bandwidth (GB/s) from summing a ``num_bytes`` fp32 tensor, timed with the
    same ``clock`` as the steps (CPU time on a shared machine), median of ``repeats``."""
    import torch

    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    times = []
    for _ in range(repeats):
        t0 = clock()
        buf.sum()
        times.append(clock() - t0)
    return num_bytes / statistics.median(times) / 1e9


def median_decode_step(
    drv: Any, prompts: list[list[int]], steps: int, clock: Callable[[], float]
) -> float:
    """Prefill ``prompts`` on the runner driver ``drv`` (room for ``steps`` + 4 more
    tokens each), one warm-up decode step, then the median of ``steps`` timed ones (s)."""
    drv.prefill(prompts, reserve=steps + 4)
    drv.decode_step()  # warm-up
    times = []
    for _ in range(steps):
        t0 = clock()
        drv.decode_step()
        times.append(clock() - t0)
    return statistics.median(times)


def streamed_weight_bytes(model: Any) -> int:
    """Bytes a decode step reads from the weights (see
    :meth:`~kvserve.model.llama.LlamaForCausalLM.streamed_weight_bytes`)."""
    return int(model.streamed_weight_bytes())


def kv_bytes_read(model: Any, batch: int, context: int, elem_size: int) -> int:
    """K and V bytes a decode step of ``batch`` requests at ``context`` tokens reads."""
    c = model.config
    return batch * context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * elem_size


def decode_rows(
    loaded: Any,
    label: str,
    driver_factory: Callable[[Any], Any],
    batches: list[int],
    context: int,
    steps: int,
    bandwidth_gb_s: float,
    clock: Callable[[], float],
    prompts: Callable[[int, int], list[list[int]]],
) -> list[dict[str, Any]]:
    """Median decode step per batch size for one loaded model, with its limit."""
    drv = driver_factory(loaded)
    weights = streamed_weight_bytes(loaded.model)
    elem = loaded.dtype.itemsize
    rows = []
    for batch in batches:
        step = median_decode_step(drv, prompts(batch, context), steps, clock)
        kv = kv_bytes_read(loaded.model, batch, context, elem)
        limit = (weights + kv) / (bandwidth_gb_s * 1e9)
        rows.append(
            {
                "weights": label,
                "formats": loaded.quantization,
                "batch": batch,
                "step_ms": step * 1e3,
                "tok_s": batch / step,
                "stream_mb": (weights + kv) / 1e6,
                "resident_weight_mb": loaded.model.weight_bytes() / 1e6,
                "limit_ms": limit * 1e3,
                "fraction_of_bandwidth": limit / step,
            }
        )
    return rows


def print_rows(rows: list[dict[str, Any]], bandwidth_gb_s: float) -> None:
    print(f"decode by weight format, read bandwidth {bandwidth_gb_s:.1f} GB/s measured:")
    print(
        f"{'weights':<10}{'formats':<14}{'batch':>6}{'step ms':>9}{'tok/s':>9}"
        f"{'stream MB':>11}{'resident MB':>13}{'limit ms':>10}{'of BW':>7}"
    )
    for r in rows:
        print(
            f"{r['weights']:<10}{r['formats']:<14}{r['batch']:>6}{r['step_ms']:>9.2f}"
            f"{r['tok_s']:>9.1f}{r['stream_mb']:>11.1f}{r['resident_weight_mb']:>13.1f}"
            f"{r['limit_ms']:>10.2f}{r['fraction_of_bandwidth']:>7.0%}"
        )
