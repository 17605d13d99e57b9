"""``peers.py agree``: kvserve's greedy output against llama.cpp's on the same GGUF file.

llama.cpp's server runs the shipped Q4_1 file (127.0.0.1, one slot, started and stopped
here, one thread by default: its spinning thread pool crawls on a loaded machine); kvserve runs the same file offline (``kvserve_greedy.py`` in the project's venv),
once per option set (default: ``quantization=auto`` -- Q4_1 executed natively -- and
``quantization=none,dtype=float32`` -- dequantized float32). Both get the same prompt
token ids (llama.cpp's tokenization of :data:`agreement.PROMPTS`, raw, no chat template)
and decode greedily for ``max_tokens`` tokens with EOS ignored. The prompts' tokenization
is also compared (llama.cpp's ``/tokenize`` with ``add_special``, which is what its
``/completion`` does with a text prompt, against kvserve's tokenizer).

Prints one agreement line per kvserve option set (against llama.cpp, and against
kvserve's dequantized float32 run when there is one) and writes everything, ids included,
to ``ROOT/agree/agree.json``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from agreement import PROMPTS, compare, tokenization_mismatches

from kvserve.bench.process import wait_healthy

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIGS = ("quantization=auto", "quantization=none,dtype=float32")


def _post(port: int, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def completion_body(prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """llama.cpp ``/completion`` request for greedy ids: only the top-k sampler with k=1
    (argmax), EOS ignored, no prompt cache reuse (its logits can differ with batch shape),
    the generated ids returned in ``tokens``."""
    return {
        "prompt": prompt_ids,
        "n_predict": max_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k"],
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        "seed": 0,
    }


def parse_completion(resp: dict[str, Any], max_tokens: int) -> list[int]:
    """The generated ids of a ``/completion`` answer; raises ValueError when the answer has
    none or fewer than asked for (EOS is ignored, so a short answer is a server fault)."""
    toks = resp.get("tokens")
    if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
        raise ValueError(f"llama.cpp answered without token ids (keys {sorted(resp)})")
    if len(toks) != max_tokens:
        raise ValueError(f"llama.cpp generated {len(toks)} tokens, asked for {max_tokens}")
    return toks


def parse_tokenize(resp: dict[str, Any]) -> list[int]:
    """The ids of a ``/tokenize`` answer (plain ids, or ``{"id", "piece"}`` objects)."""
    toks = resp.get("tokens")
    if not isinstance(toks, list):
        raise ValueError(f"llama.cpp /tokenize answered without tokens (keys {sorted(resp)})")
    return [t["id"] if isinstance(t, dict) else int(t) for t in toks]


def parse_config(spec: str) -> list[str]:
    """``"quantization=none,dtype=float32"`` -> the ``--option`` values for one run."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    for p in parts:
        if "=" not in p:
            raise SystemExit(
                f"--kvserve {spec!r}: use NAME=VALUE[,NAME=VALUE], e.g. quantization=auto"
            )
    return parts


class LlamaServer:
    """llama-server on one GGUF file, 127.0.0.1, one slot; a context manager that stops it
    (its whole process group) on exit, also after an error."""

    def __init__(self, server: Path, gguf: str, port: int, log: Path, threads: int) -> None:
        self.cmd = [
            str(server), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-np", "1", "-c", "2048", "-t", str(threads), "--no-warmup",
        ]  # fmt: skip
        self.port, self.log = port, log
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        fh = open(self.log, "w")  # noqa: SIM115 - the child keeps it; closed with the process
        self.proc = subprocess.Popen(
            self.cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        fh.close()
        wait_healthy(
            f"http://127.0.0.1:{self.port}", self.proc, 180, what="llama-server", poll_s=0.5
        )
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def tokenize(self, text: str) -> list[int]:
        return parse_tokenize(_post(self.port, "/tokenize", {"content": text, "add_special": True}))

    def greedy(self, ids: list[int], max_tokens: int) -> list[int]:
        body = completion_body(ids, max_tokens)
        return parse_completion(_post(self.port, "/completion", body, timeout=900), max_tokens)


def kvserve_side(
    python: Path,
    gguf: str,
    options: list[str],
    texts: list[str],
    prompt_ids: list[list[int]] | None,
    max_tokens: int,
    work: Path,
    timeout_s: float = 900,
) -> dict[str, Any]:
    """Run ``kvserve_greedy.py`` once; ``prompt_ids=None`` decodes from kvserve's own
    tokenization of ``texts`` (returned as ``tokenized`` either way)."""
    inp, out = work / "in.json", work / "out.json"
    inp.write_text(
        json.dumps({"texts": texts, "prompt_token_ids": prompt_ids, "max_tokens": max_tokens})
    )
    cmd = [str(python), str(HERE / "kvserve_greedy.py"), str(inp), str(out), "--model", gguf]
    for o in options:
        cmd += ["--option", o]
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    subprocess.run(cmd, check=True, timeout=timeout_s, env=env)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_agree(
    root: Path,
    server: Path,
    gguf: str,
    python: Path,
    configs: list[str],
    num_prompts: int,
    max_tokens: int,
    port: int,
    threads: int = 1,
) -> dict[str, Any]:
    """The whole comparison; returns (and writes under ``root/agree``) the report dict.

    llama.cpp's tokenization fixes the prompt ids both engines decode from (kvserve's own
    tokenization is compared with it); kvserve's runs go in a background thread while
    llama.cpp decodes, and every engine's ids are saved as soon as they arrive."""
    if not server.exists():
        raise SystemExit(
            f"no llama-server at {server}: run `peers.py install llamacpp` or pass --llama-server"
        )
    if not 1 <= num_prompts <= len(PROMPTS):
        raise SystemExit(f"--prompts must be 1..{len(PROMPTS)} (got {num_prompts})")
    for spec in configs:
        parse_config(spec)
    texts = list(PROMPTS[:num_prompts])
    outdir = root / "agree"
    outdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []
    with LlamaServer(server, gguf, port, outdir / "llama_server.log", threads) as lc:
        prompt_ids = [lc.tokenize(t) for t in texts]

        def kvserve_runs() -> None:
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    for i, spec in enumerate(configs):
                        r = kvserve_side(
                            python,
                            gguf,
                            parse_config(spec),
                            texts,
                            prompt_ids,
                            max_tokens,
                            Path(tmp),
                        )
                        (outdir / f"kvserve_{i}.json").write_text(json.dumps({"config": spec, **r}))
                        runs[spec] = r
                        print(f"kvserve {spec}: done", flush=True)
            except BaseException as e:  # reported after llama.cpp's half
                errors.append(e)

        worker = threading.Thread(target=kvserve_runs, daemon=True)
        worker.start()
        lc_out = []
        for ids in prompt_ids:
            lc_out.append(lc.greedy(ids, max_tokens))
        (outdir / "llamacpp.json").write_text(
            json.dumps({"prompt_token_ids": prompt_ids, "outputs": lc_out})
        )
        print("llama.cpp: done", flush=True)
    worker.join()
    if errors:
        raise SystemExit(f"a kvserve run failed: {errors[0]!r}")
    kv_tok = runs[configs[0]]["tokenized"]
    mism = tokenization_mismatches(prompt_ids, kv_tok)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gguf": gguf,
        "prompts": num_prompts,
        "max_tokens": max_tokens,
        "tokenization_mismatches": mism,
        "prompt_token_ids": prompt_ids,
        "llamacpp_outputs": lc_out,
        "kvserve": {},
    }
    print(
        f"tokenization: {num_prompts - len(mism)}/{num_prompts} prompts identical"
        + (f" (differ: {mism})" if mism else ""),
        flush=True,
    )
    dq = next((s for s in configs if "quantization=none" in s), None)
    for spec in configs:
        outs = runs[spec]["outputs"]
        vs_lc = compare(lc_out, outs)
        entry: dict[str, Any] = {"outputs": outs, "vs_llamacpp": vs_lc.as_dict()}
        print(f"kvserve {spec:34} vs llama.cpp: {vs_lc.line()}", flush=True)
        if dq is not None and spec != dq:
            vs_dq = compare(runs[dq]["outputs"], outs)
            entry["vs_kvserve_dequantized"] = vs_dq.as_dict()
            print(f"kvserve {spec:34} vs kvserve {dq}: {vs_dq.line()}", flush=True)
        report["kvserve"][spec] = entry
    (outdir / "agree.json").write_text(json.dumps(report, indent=1))
    print(f"written: {outdir / 'agree.json'}")
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The agreement rows ``peers.py table`` prints from a saved ``agree.json``."""
    lines = [
        f"greedy agreement with llama.cpp ({report['date']}, {report['prompts']} prompts x "
        f"{report['max_tokens']} tokens, tokenization mismatches: "
        f"{len(report['tokenization_mismatches'])})"
    ]
    for spec, entry in report["kvserve"].items():
        a = entry["vs_llamacpp"]
        mfd = a["mean_first_divergence"]
        line = (
            f"  kvserve {spec:34} exact {a['exact']:>2}/{a['sequences']}  "
            f"first div {'-' if mfd is None else f'{mfd:.1f}':>5}  "
            f"agreement {a['token_agreement']:.1%}"
        )
        dq = entry.get("vs_kvserve_dequantized")
        if dq:
            line += f"  (vs kvserve dequantized: exact {dq['exact']}/{dq['sequences']}, {dq['token_agreement']:.1%})"
        lines.append(line)
    return lines


if __name__ == "__main__":
    sys.exit("run through peers.py: python benchmarks/peers/peers.py agree")
