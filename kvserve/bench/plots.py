"""PNG plots of a benchmark run: CDFs of TTFT and ITL, and a tokens/s timeline.

Uses matplotlib's object API with the Agg canvas (no pyplot, no display, no global
backend switch), so it is safe in threads, tests and headless machines.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.bench.metrics import RequestResult, token_timeline

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _new_figure(width: float = 7.0, height: float = 4.0) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _cdf_plot(values_ms: list[float], title: str, xlabel: str, path: Path) -> None:
    fig = _new_figure()
    ax = fig.add_subplot()
    if values_ms:
        xs = sorted(values_ms)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post")
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def default_bin_s(duration_s: float) -> float:
    """A timeline bin width giving about 50 bins, between 50 ms and 10 s."""
    return min(10.0, max(0.05, duration_s / 50))


def write_plots(
    results: list[RequestResult], out_dir: Path, duration_s: float, title: str = ""
) -> list[Path]:
    """Write ``ttft_cdf.png``, ``itl_cdf.png`` and ``timeline.png`` into ``out_dir``.

    Only successful requests are plotted; ITL only from streamed ones. Returns the
    paths written. ``out_dir`` must exist.
    """
    ok = [r for r in results if r.success]
    prefix = f"{title}: " if title else ""
    paths = [out_dir / "ttft_cdf.png", out_dir / "itl_cdf.png", out_dir / "timeline.png"]
    _cdf_plot(
        [r.ttft * 1000 for r in ok if r.chunk_times], f"{prefix}TTFT CDF", "TTFT (ms)", paths[0]
    )
    itls = [g * 1000 for r in ok if r.streamed for g in r.itls]
    _cdf_plot(itls, f"{prefix}inter-token latency CDF", "ITL (ms)", paths[1])

    bin_s = default_bin_s(duration_s)
    starts, rates = token_timeline(results, bin_s, duration_s)
    fig = _new_figure(9.0, 4.0)
    ax = fig.add_subplot()
    ax.bar(starts, rates, width=bin_s, align="edge", alpha=0.7, label="output tokens/s")
    arrivals = [r.send_time for r in results]
    if arrivals:
        top = max(rates, default=0.0) or 1.0
        ax.plot(
            arrivals,
            [top * 1.03] * len(arrivals),
            "|",
            color="tab:red",
            markersize=10,
            label="request sent",
        )
    ax.set_title(f"{prefix}output tokens per second ({bin_s:.2g} s bins)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("tokens/s")
    ax.legend(loc="upper right")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[2])
    return paths
