"""Is throughput the same from one server start to the next?

Starts ``kvserve serve`` (default model, bfloat16, no flags beyond ``--kv-flags``) N
times, each a fresh process, and runs the shared-prefix row (``prefix``) and the
interference row (the shared JSONL workload at ``--rate`` requests/s) with vLLM's own
bench client, as ``benchmarks/peers/peers.py`` does. Prints every start's output tok/s,
the max/min ratio per row (target: <= 1.15), and each start's "step budget" and
step-time model lines from its log, so a spread can be traced to the budget chosen.

``--fit auto`` (default) is what a user gets: the first start calibrates and stores the
step-time fit when it is steady, later starts check it and reuse it. ``--fit refresh``
makes every start calibrate again (the spread of fresh fits); ``--clear-fit`` deletes
the stored fits before the first start.

Usage, from the repository root after ``make setup`` and ``peers.py install vllm``, on
a quiet machine::

    python benchmarks/steady_starts.py --starts 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import peers  # noqa: E402

from kvserve.bench.process import wait_healthy

INTERFERENCE = peers.REPO.parent / "shared" / "peer" / "workloads" / "interference.jsonl"


def spread(values: list[float]) -> float:
    """max / min of positive values (inf when one is 0 or absent)."""
    if not values or min(values) <= 0:
        return float("inf")
    return max(values) / min(values)


def log_lines(log: Path, needles: tuple[str, ...]) -> list[str]:
    """The lines of a server log that hold any of ``needles``."""
    if not log.exists():
        return []
    text = log.read_text(errors="replace").splitlines()
    return [line.strip() for line in text if any(n in line for n in needles)]


def huge_pages(pid: int) -> str:
    """A server's resident and huge-page-backed anonymous memory (Linux), as text."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return "smaps_rollup not readable"
    keep = [ln.split() for ln in lines if ln.startswith(("Rss:", "AnonHugePages:"))]
    return ", ".join(f"{k[0]} {int(k[1]) // 1024} MiB" for k in keep)


def interleaved(args: argparse.Namespace) -> int:
    """``--interleave``: every server up at once, the row run round-robin over them."""
    lay = peers.Layout(args.root)
    tokenizer = peers._model_folder()
    flags = f"--step-cost-cache {args.fit} {args.kv_flags}".strip()
    base = peers.WORKLOADS["prefix"]
    procs, logs = [], []
    try:
        for i in range(args.starts):
            port = args.port + i
            cmd, env = peers._server_command(lay, "kvserve", "bfloat16", port, flags)
            log = open(lay.logs / f"server_interleave{i}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            wait_healthy(
                f"http://127.0.0.1:{port}", procs[-1], 900, poll_s=0.5
            )  # one start at a time
            peers._bench(lay, f"warm_interleave{i}", tokenizer, port, peers.WARMUP)
            print(f"server {i}: {huge_pages(procs[-1].pid)}", flush=True)
        table: list[list[float]] = [[] for _ in range(args.starts)]
        for r in range(args.interleave):
            seed = ["--seed", str(peers._seed(base) + 1000 * r)]
            for i in range(args.starts):
                res = peers._bench(
                    lay, f"prefix_interleave{i}_r{r}", tokenizer, args.port + i, [*base, *seed]
                )
                table[i].append(float(res["output_throughput"]) if res else 0.0)
                print(f"round {r} server {i}: {table[i][-1]:.1f} tok/s", flush=True)
        # The interference row once per server (fixed prompts: a second run on the same
        # server would hit its prefix cache), servers in turn.
        rate = args.rate
        inter_args = peers._workload_args(
            "interference", None, rate, jsonl={"interference": (str(INTERFERENCE), rate)}
        )
        inter: list[float] = []
        for i in range(args.starts):
            res = peers._bench(
                lay, f"interference_interleave{i}", tokenizer, args.port + i, inter_args
            )
            inter.append(float(res["output_throughput"]) if res else 0.0)
            print(f"interference server {i}: {inter[-1]:.1f} tok/s", flush=True)
    finally:
        for proc in procs:
            peers._stop(proc)
        for log in logs:
            log.close()
    medians = [statistics.median(row) for row in table]
    rounds = [statistics.median(col) for col in zip(*table, strict=True)]
    print(f"\n{args.starts} servers up at once, shared-prefix row, output tok/s:")
    for i, row in enumerate(table):
        cells = "  ".join(f"{v:7.1f}" for v in row)
        print(f"  server {i}: {cells}   median {medians[i]:7.1f}")
    print(f"  between servers (medians) max/min {spread(medians):.3f}")
    print(f"  between rounds (medians)  max/min {spread(rounds):.3f}")
    cells = "  ".join(f"{v:7.1f}" for v in inter)
    print(
        f"  interference ({args.rate} req/s), once per server: {cells}   max/min {spread(inter):.3f}"
    )
    out = lay.results / "steady_starts_interleaved.json"
    out.write_text(
        json.dumps(
            {"table": table, "medians": medians, "rounds": rounds, "interference": inter},
            indent=1,
        )
    )
    print(f"written {out}")
    return 0 if spread(medians) <= 1.15 and spread(inter) <= 1.15 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "kvserve-peers")
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--rate", default="3", help="interference requests/s")
    ap.add_argument("--fit", choices=("auto", "refresh"), default="auto")
    ap.add_argument("--clear-fit", action="store_true", help="delete stored fits first")
    ap.add_argument("--kv-flags", default="", help="extra flags for kvserve serve")
    ap.add_argument("--port", type=int, default=8320)
    ap.add_argument(
        "--repeats", type=int, default=1,
        help="runs of the shared-prefix row per start (fresh seeds); the start's figure is "
        "their median, and the spread within each start is printed beside the spread "
        "between starts",
    )  # fmt: skip
    ap.add_argument(
        "--interleave", type=int, default=0, metavar="ROUNDS",
        help="start all --starts servers at once and run the shared-prefix row ROUNDS "
        "times on each in turn (server 0, 1, ..., then the next round with a fresh "
        "seed): a start effect shows as servers that stay apart in every round, the "
        "machine's drift as rounds that move together",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.interleave:
        return interleaved(args)
    if args.starts < 2:
        raise SystemExit("--starts must be at least 2")
    lay = peers.Layout(args.root)
    if args.clear_fit:
        from kvserve.worker.step_cost_store import store_dir

        shutil.rmtree(store_dir(), ignore_errors=True)
    flags = f"--step-cost-cache {args.fit} {args.kv_flags}".strip()
    workloads = ["prefix", "interference"]
    jsonl = {"interference": (str(INTERFERENCE), args.rate)}
    figures: dict[str, list[float]] = {w: [] for w in workloads}
    within: dict[str, list[list[float]]] = {w: [] for w in workloads}
    notes: list[list[str]] = []
    for i in range(args.starts):
        suffix = f"_steady{i}"
        peers.run_targets(
            lay, ["kvserve:bfloat16"], workloads, None, args.rate, flags, args.port,
            suffix=suffix, jsonl=jsonl, repeats=args.repeats,
        )  # fmt: skip
        for w in workloads:
            runs = []
            for r in range(args.repeats if w in peers.WORKLOADS else 1):
                path = lay.results / (
                    f"{w}_kvserve_bfloat16{suffix}" + (f"_r{r}" if r else "") + ".json"
                )
                runs.append(
                    float(json.loads(path.read_text())["output_throughput"])
                    if path.exists()
                    else 0.0
                )
            within[w].append(runs)
            figures[w].append(statistics.median(runs))
        log = lay.logs / f"server_kvserve_bfloat16{suffix}.log"
        notes.append(log_lines(log, ("step budget:", "step-time model", "step-time fit")))
    print(f"\n{args.starts} starts, --step-cost-cache {args.fit}, output tok/s:")
    for w in workloads:
        vals = figures[w]
        cells = "  ".join(f"{v:7.1f}" for v in vals)
        print(f"  {w:13s} {cells}   max/min {spread(vals):.3f}")
        if any(len(runs) > 1 for runs in within[w]):
            inner = "  ".join(f"{spread(runs):7.3f}" for runs in within[w])
            print(f"  {'(within)':13s} {inner}   max/min of each start's runs")
    for i, lines in enumerate(notes):
        print(f"start {i}:")
        for line in lines:
            print(f"    {line}")
    out = lay.results / f"steady_starts_{args.fit}.json"
    out.write_text(
        json.dumps(
            {
                "fit": args.fit,
                "figures": figures,
                "max_min": {w: spread(v) for w, v in figures.items()},
                "runs": within,
                "logs": notes,
            },
            indent=1,
        )
    )
    print(f"written {out}")
    return 0 if all(spread(v) <= 1.15 for v in figures.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
