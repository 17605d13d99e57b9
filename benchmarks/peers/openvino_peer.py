"""OpenVINO GenAI in the peer harness: install, export, and offline runs against kvserve.

OpenVINO ships no OpenAI server in the registries, so this compares the engines offline
(``offline_driver.py``): OpenVINO's ContinuousBatchingPipeline against kvserve's
``LLM.generate`` on the same texts, greedy, EOS ignored, the same scheduler limits::

    python benchmarks/peers/peers.py install openvino    # venv + fp16/int8/int4 IR export
    python benchmarks/peers/peers.py offline openvino:int8 openvino:int4 kvserve
    python benchmarks/peers/peers.py offline kvserve:quantization=none,dtype=float32
    python benchmarks/peers/peers.py table

Targets: ``openvino:{fp16,int8,int4}`` (the IR exported by ``install openvino`` from the
same converted model folder kvserve serves), ``kvserve`` (its defaults) or
``kvserve:NAME=VALUE[,...]`` (``LLM`` options). Everything lives under the harness root:
``openvino-venv/``, ``openvino-ir/smol-FORMAT/``, ``offline/`` (one JSON result per
target plus the prompts used). The machine must be quiet while this measures.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from offline_driver import last_result

HERE = Path(__file__).resolve().parent
OPENVINO_GENAI_VERSION = "2026.4.1.0"
OPTIMUM_INTEL_VERSION = "2.2.0"
OV_FORMATS = ("fp16", "int8", "int4")
# int4: group-wise with groups of 64 (the model's 576 columns are not a multiple of 128),
# every layer 4-bit (ratio 1.0; optimum's default keeps some in int8).
EXPORT_EXTRA = {"int4": ["--group-size", "64", "--ratio", "1.0"]}
_WORDS = [
    "river",
    "stone",
    "light",
    "morning",
    "garden",
    "window",
    "paper",
    "music",
    "city",
    "road",
    "answer",
    "table",
    "story",
    "friend",
    "winter",
    "number",
    "market",
    "letter",
    "school",
    "field",
    "summer",
    "mountain",
    "question",
    "voice",
]


def ov_venv(root: Path) -> Path:
    return root / "openvino-venv"


def ov_ir(root: Path, fmt: str) -> Path:
    return root / "openvino-ir" / f"smol-{fmt}"


def install_openvino(root: Path, torch_version: str, model_folder: str) -> None:
    """OpenVINO GenAI and optimum-intel in their own venv (never the project's), then the
    default model's folder exported to OpenVINO IR in each of :data:`OV_FORMATS`."""
    venv, logs = ov_venv(root), root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    _logged(
        pip
        + [
            f"torch=={torch_version}",
            f"optimum-intel[openvino]=={OPTIMUM_INTEL_VERSION}",
            f"openvino-genai=={OPENVINO_GENAI_VERSION}",
        ],
        logs / "pip_openvino.log",
    )
    # The registry's vision/audio wheels break transformers' imports on this torch; a text
    # model needs none of them.
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio"], check=False
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for fmt in OV_FORMATS:
        out = ov_ir(root, fmt)
        if (out / "openvino_model.xml").exists():
            print(f"IR {fmt}: already at {out}")
            continue
        _logged(
            [
                str(venv / "bin" / "optimum-cli"),
                "export",
                "openvino",
                "--model",
                model_folder,
                "--task",
                "text-generation-with-past",
                "--weight-format",
                fmt,
                *EXPORT_EXTRA.get(fmt, []),
                str(out),
            ],
            logs / f"openvino_export_{fmt}.log",
            env=env,
        )
        print(f"IR {fmt}: {out}")


def _logged(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        raise SystemExit(f"failed (exit {rc}); see {log}")


def make_prompts(
    batch_prompts: int, batch_words: int, single_prompts: int, single_words: int, seed: int = 7
) -> dict[str, list[str]]:
    """Deterministic word-salad prompts (one word is about one token for this tokenizer)."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    return {
        "batch": [text(batch_words) for _ in range(batch_prompts)],
        "single": [text(single_words) for _ in range(single_prompts)],
    }


def parse_target(target: str) -> tuple[str, str, list[str]]:
    """``openvino:int8`` -> ("openvino", "int8", []); ``kvserve:a=1,b=2`` -> ("kvserve",
    "a=1,b=2", ["a=1", "b=2"]); ``kvserve`` -> ("kvserve", "default", [])."""
    engine, _, fmt = target.partition(":")
    if engine == "openvino":
        if fmt not in OV_FORMATS:
            raise SystemExit(f"openvino formats: {', '.join(OV_FORMATS)} (got {fmt!r})")
        return engine, fmt, []
    if engine == "kvserve":
        opts = [p.strip() for p in fmt.split(",") if p.strip()]
        bad = [p for p in opts if "=" not in p]
        if bad:
            raise SystemExit(f"kvserve options are NAME=VALUE[,...] (got {bad})")
        return engine, ",".join(opts) or "default", opts
    raise SystemExit(
        f"offline targets: openvino:FORMAT or kvserve[:NAME=VALUE,...] (got {target!r})"
    )


def result_name(engine: str, fmt: str) -> str:
    return f"{engine}_{re.sub(r'[^A-Za-z0-9.]+', '-', fmt)}.json"


def run_offline(
    root: Path,
    targets: list[str],
    kvserve_python: Path,
    prompts: dict[str, list[str]],
    max_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    timeout_s: float = 3600,
) -> list[dict[str, Any]]:
    """Each target in turn, in its own process; returns (and saves) the results."""
    parsed = [parse_target(t) for t in targets]  # every target checked before any runs
    out_dir = root / "offline"
    out_dir.mkdir(parents=True, exist_ok=True)
    pfile = out_dir / "prompts.json"
    pfile.write_text(
        json.dumps(
            {
                **prompts,
                "max_tokens": max_tokens,
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens,
            }
        )
    )
    results = []
    for engine, fmt, opts in parsed:
        driver = str(HERE / "offline_driver.py")
        env = dict(os.environ)
        if engine == "openvino":
            py = ov_venv(root) / "bin" / "python"
            ir = ov_ir(root, fmt)
            if not py.exists() or not (ir / "openvino_model.xml").exists():
                raise SystemExit(f"no OpenVINO venv or IR {ir}: run `peers.py install openvino`")
            cmd = [str(py), driver, "openvino", str(pfile), "--model", str(ir), "--format", fmt]
        else:
            env["PYTHONPATH"] = str(HERE.parents[1])
            cmd = [str(kvserve_python), driver, "kvserve", str(pfile), "--format", fmt]
            for o in opts:
                cmd += ["--option", o]
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        log = root / "logs" / f"offline_{result_name(engine, fmt)[:-5]}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            print(f"[{engine}:{fmt}] failed (exit {proc.returncode}); see {log}")
            continue
        res = last_result(proc.stdout)
        (out_dir / result_name(engine, fmt)).write_text(json.dumps(res))
        print(
            f"[{engine}:{fmt}] "
            + " ".join(f"{k}={res[k]}" for k in ("batch_tok_s", "single_tok_s"))
        )
        results.append(res)
    return results


def offline_table(results: list[dict[str, Any]]) -> str:
    """Rows of offline results, with each rate's ratio to kvserve's default row."""
    if not results:
        return ""
    ref = next((r for r in results if r["engine"] == "kvserve" and r["format"] == "default"), None)

    def ratio(r: dict[str, Any], key: str) -> str:
        if ref is None or not ref.get(key) or not r.get(key):
            return "-"
        return f"{r[key] / ref[key]:.2f}"

    lines = [
        f"{'offline target':36} {'batch tok/s':>11} {'vs kv':>6} {'single tok/s':>12} "
        f"{'vs kv':>6} {'prompt toks':>11}"
    ]
    for r in results:
        bt = "-" if r["batch_tok_s"] is None else f"{r['batch_tok_s']:.1f}"
        st = "-" if r["single_tok_s"] is None else f"{r['single_tok_s']:.1f}"
        lines.append(
            f"{r['engine'] + ':' + r['format']:36} {bt:>11} {ratio(r, 'batch_tok_s'):>6} "
            f"{st:>12} {ratio(r, 'single_tok_s'):>6} "
            f"{r['batch_prompt_tokens'] + r['single_prompt_tokens']:>11}"
        )
    toks = {r["batch_prompt_tokens"] + r["single_prompt_tokens"] for r in results}
    if len(toks) > 1:
        lines.append("note: the engines tokenized the prompts differently (prompt toks differ)")
    return "\n".join(lines)


def saved_results(root: Path) -> list[dict[str, Any]]:
    """The offline results saved under ``root/offline`` (prompts.json excluded)."""
    out = []
    for p in sorted((root / "offline").glob("*.json")):
        if p.name == "prompts.json":
            continue
        try:
            out.append(json.loads(p.read_text()))
        except json.JSONDecodeError:
            continue
    return out
