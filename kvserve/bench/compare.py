"""``kvserve bench compare``: one workload, several engine configurations, one table.

Each kvserve configuration (a :class:`Variant`) runs as its own server process,
``<serve command> --host 127.0.0.1 --port P [--model M] <variant args> <extra args>``,
started in turn, waited on through ``GET /health``, measured over HTTP with the load
generator of ``kvserve bench serve``, and stopped (SIGTERM, then kill after a grace
period). The HF transformers baseline runs in this process (see ``hf_baseline``).
Every variant writes its own ``results.json`` and plots under ``<output>/<variant>/``;
the table goes to stdout and ``<output>/compare.json``.

Engine flags used by the presets follow vLLM's spelling (``--enable-prefix-caching``,
``--no-enable-prefix-caching``, ``--max-num-batched-tokens``, ``--scheduler-policy``),
the spelling of ``kvserve serve``'s engine options.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvserve.bench.disagg import scrape_metrics, transfer_figures
from kvserve.bench.loadgen import LoadConfig, run_workload
from kvserve.bench.metrics import SLO
from kvserve.bench.presets import PRESETS, ComparePreset, Figure, Target, Variant, ratio
from kvserve.bench.process import free_port, stop_process, wait_healthy
from kvserve.bench.report import build_report, write_report
from kvserve.bench.workloads import (
    WordVocabulary,
    Workload,
    build_workload,
    render_prompt,
)


def figure_value(report: dict[str, Any], key: str) -> float | None:
    """The figure ``key`` ("name" or "tag/name") of a results.json ``report``."""
    if "/" in key:
        tag, name = key.split("/", 1)
        value = report.get("by_tag", {}).get(tag, {}).get(name)
    else:
        value = report["summary"].get(key)
    return None if value is None else float(value)


def figure_values(
    reports: dict[str, dict[str, Any]], figures: tuple[Figure, ...]
) -> dict[str, dict[str, float | None]]:
    """{variant: {figure key: value}} for every variant's report."""
    return {
        name: {f.key: figure_value(rep, f.key) for f in figures} for name, rep in reports.items()
    }


def _cell(value: float | None, ref: float | None, is_reference: bool) -> str:
    if value is None:
        return "n/a"
    text = f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    if is_reference:
        return f"{text} (ref)"
    r = ratio(value, ref)
    return f"{text} ({r:.2f}x)" if r is not None else text


def format_table(
    values: dict[str, dict[str, float | None]], figures: tuple[Figure, ...], reference: str
) -> str:
    """A Markdown table: one row per variant, one column per figure, each cell the
    value and its ratio to the ``reference`` variant's. Raises ValueError when
    ``reference`` is not a variant."""
    if reference not in values:
        raise ValueError(
            f"invalid reference={reference!r}: must be one of the variants {', '.join(values)} "
            f"(for example: --reference {next(iter(values), 'NAME')})"
        )
    header = ["variant", *[f.label for f in figures]]
    rows = [header, ["---"] * len(header)]
    for name, vals in values.items():
        rows.append(
            [
                name,
                *[
                    _cell(vals.get(f.key), values[reference].get(f.key), name == reference)
                    for f in figures
                ],
            ]
        )
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def default_serve_command() -> list[str]:
    return [sys.executable, "-m", "kvserve.entrypoints.cli", "serve"]


class ServerProcess:
    """A server subprocess, its output in ``log_path``; a context manager that stops it.

    ``wait_healthy`` polls ``GET /health`` until 200, raising RuntimeError (with the
    log's tail) if the process exits or ``timeout_s`` passes.
    """

    def __init__(
        self, command: list[str], log_path: Path, port: int, threads: int | None = None
    ) -> None:
        self.command = command
        self.log_path = log_path
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = os.environ | {"TOKENIZERS_PARALLELISM": "false"}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def log_tail(self, num_chars: int = 2000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until /health answered 200."""
        return wait_healthy(
            self.base_url,
            self.proc,
            timeout_s,
            poll_s=0.25,
            log_tail=lambda: f"command: {shlex.join(self.command)}\n{self.log_tail()}",
        )

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL. Returns the exit code."""
        code = stop_process(self.proc, grace_s)
        self._log.close()
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class CompareOptions:
    """How to run a preset. ``serve_command`` is the server's argv prefix (tests and
    other builds may replace it); ``extra_engine_args`` go to every kvserve variant."""

    model: str | None = None
    output_dir: Path = Path("bench_results/compare")
    serve_command: list[str] = field(default_factory=default_serve_command)
    extra_engine_args: tuple[str, ...] = ()
    reference: str | None = None
    startup_timeout_s: float = 600.0
    hf_batch_size: int = 8
    skip_hf: bool = False
    seed: int = 0
    progress: bool = True
    plots: bool = True
    rounds: int = 1  # > 1: variants interleaved round by round, figures are medians


def _run_kvserve_variant(
    preset: ComparePreset, variant: Variant, workload: Workload, opts: CompareOptions, out_dir: Path
) -> dict[str, Any]:
    port = free_port()
    command = [*opts.serve_command, "--host", "127.0.0.1", "--port", str(port)]
    if opts.model:
        command += ["--model", opts.model]
    command += [*variant.engine_args, *opts.extra_engine_args]
    with contextlib.ExitStack() as stack:
        prefill: ServerProcess | None = None
        if variant.prefill_args is not None:
            kv_address = f"127.0.0.1:{free_port()}"
            prefill_port = free_port()
            prefill_cmd = [*command, "--kv-role", "prefill", "--kv-address", kv_address]
            prefill_cmd[prefill_cmd.index("--port") + 1] = str(prefill_port)
            prefill = stack.enter_context(
                ServerProcess(
                    [*prefill_cmd, *variant.prefill_args],
                    out_dir / "prefill.log",
                    prefill_port,
                    variant.threads,
                )
            )
            command += ["--kv-role", "decode", "--kv-prefill-peers", kv_address]
        server = stack.enter_context(
            ServerProcess(command, out_dir / "server.log", port, variant.threads)
        )
        startup_s = server.wait_healthy(opts.startup_timeout_s)
        if prefill is not None:
            prefill.wait_healthy(opts.startup_timeout_s)
        config = LoadConfig(
            base_url=server.base_url,
            request_rate=preset.request_rate,
            max_concurrency=preset.max_concurrency,
            seed=opts.seed,
            num_warmup=preset.num_warmup,
            progress=opts.progress,
        )
        run = run_workload(workload, config)
        transfer = (
            transfer_figures(scrape_metrics(server.base_url), scrape_metrics(prefill.base_url))
            if prefill is not None
            else {}
        )
    cfg = run.config_json() | {"variant": variant.name, "command": command, "startup_s": startup_s}
    cfg["threads"] = variant.threads
    report = build_report(
        run.results,
        run.duration_s,
        workload,
        SLO(),
        cfg,
        run.prefix_cache,
        kind="compare",
        spec_decode=run.spec_decode,
    )
    report["summary"].update(transfer)
    write_report(report, run.results, out_dir, plots=opts.plots, title=variant.name)
    return report


def _run_hf_variant(
    variant: Variant, workload: Workload, opts: CompareOptions, out_dir: Path
) -> dict[str, Any]:
    from kvserve.bench.hf_baseline import DEFAULT_MODEL, load_hf_model, run_hf_baseline

    if any(len(s.turns) > 1 for s in workload.sessions):
        raise ValueError("the HF baseline runs single-turn workloads only (not multi-turn)")
    model_name = opts.model or DEFAULT_MODEL
    hf_model, tokenizer = load_hf_model(model_name)
    prompts = [render_prompt(s, 0, []) for s in workload.sessions]
    output_lens = [s.turns[0].output_len for s in workload.sessions]
    results, duration = run_hf_baseline(
        prompts,
        output_lens,
        hf_model,
        tokenizer,
        batch_size=opts.hf_batch_size,
        progress=opts.progress,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "variant": variant.name,
        "backend": "hf",
        "model": model_name,
        "batch_size": opts.hf_batch_size,
    }
    report = build_report(results, duration, workload, SLO(), cfg, None, kind="compare")
    write_report(report, results, out_dir, plots=opts.plots, title=variant.name)
    return report


def run_compare(
    preset: ComparePreset, opts: CompareOptions, vocab: WordVocabulary | None = None
) -> dict[str, Any]:
    """Run every variant of ``preset`` in turn and return the comparison.

    Returns ``{"preset", "description", "reference", "figures", "values", "table",
    "target"}`` and writes it to ``<output_dir>/compare.json``. A variant that fails
    (server exits, not healthy in time) is recorded under "errors" and shows n/a in
    the table; the others still run.
    """
    reference = opts.reference or preset.reference
    variants = [v for v in preset.variants if not (opts.skip_hf and v.backend == "hf")]
    names = [v.name for v in variants]
    if reference not in names:
        raise ValueError(
            f"invalid reference={reference!r}: must be one of {', '.join(names)} (for example: --reference {names[0]})"
        )
    workload = build_workload(replace(preset.workload, seed=opts.seed), vocab)
    opts.output_dir.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}
    if opts.rounds < 1:
        raise ValueError(f"invalid rounds={opts.rounds!r}: must be >= 1 (for example: --rounds 3)")
    per_round: list[dict[str, dict[str, float | None]]] = []
    for k in range(opts.rounds):
        reports: dict[str, dict[str, Any]] = {}
        for variant in variants:
            out_dir = opts.output_dir / variant.name
            if opts.rounds > 1:
                out_dir = out_dir / f"round-{k}"
            out_dir.mkdir(parents=True, exist_ok=True)
            print(f"[compare {preset.name}] {variant.name} ...", file=sys.stderr, flush=True)
            try:
                if variant.backend == "hf":
                    reports[variant.name] = _run_hf_variant(variant, workload, opts, out_dir)
                else:
                    reports[variant.name] = _run_kvserve_variant(
                        preset, variant, workload, opts, out_dir
                    )
            except (RuntimeError, ValueError, OSError) as e:
                errors[variant.name] = str(e)
                print(
                    f"[compare {preset.name}] {variant.name} failed: {e}",
                    file=sys.stderr,
                    flush=True,
                )
        per_round.append(figure_values(reports, preset.figures))
    values = _median_values(per_round, preset.figures)
    for name in names:
        values.setdefault(name, {f.key: None for f in preset.figures})
    values = {name: values[name] for name in names}
    checked = []
    for claim in (preset.target, *preset.more_targets):
        if claim is not None:
            r, met = claim.check(values)
            checked.append({"claim": claim.describe(), "ratio": r, "met": met})
    target = checked[0] if preset.target is not None else None
    result = {
        "preset": preset.name,
        "description": preset.description,
        "reference": reference,
        "figures": [asdict(f) for f in preset.figures],
        "values": values,
        "table": format_table(values, preset.figures, reference),
        "target": target,
        "more_targets": checked[1:] if preset.target is not None else checked,
        "errors": errors,
        "workload": workload.describe(),
        "rounds": per_round,
    }
    (opts.output_dir / "compare.json").write_text(json.dumps(result, indent=1))
    return result


def _median_values(
    per_round: list[dict[str, dict[str, float | None]]], figures: tuple[Figure, ...]
) -> dict[str, dict[str, float | None]]:
    """Per variant and figure, the median over the rounds that measured it."""
    out: dict[str, dict[str, float | None]] = {}
    for values in per_round:
        for name in values:
            out.setdefault(name, {})
    for name in out:
        for f in figures:
            got = [v for r in per_round if (v := r.get(name, {}).get(f.key)) is not None]
            out[name][f.key] = statistics.median(got) if got else None
    return out


def format_result(result: dict[str, Any]) -> str:
    """The printed form of :func:`run_compare`'s result: title, table, target, errors."""
    lines = [
        f"## bench compare {result['preset']}: {result['description']}",
        "",
        result["table"],
        "",
    ]
    claims = [result["target"]] if result["target"] else []
    for t in claims + list(result.get("more_targets", [])):
        verdict = "not measured" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
        shown = "n/a" if t["ratio"] is None else f"{t['ratio']:.3f}"
        lines.append(f"target {t['claim']}: ratio {shown} -> {verdict}")
    for name, err in result["errors"].items():
        lines.append(f"error in {name}: {err.splitlines()[0] if err else ''}")
    return "\n".join(lines)


def serve_command_from_string(text: str | None) -> list[str]:
    """``--serve-command`` as argv; the default runs this interpreter's kvserve."""
    if not text:
        return default_serve_command()
    argv = shlex.split(text)
    if not argv:
        raise ValueError(
            "invalid --serve-command '': give a command (for example: --serve-command 'kvserve serve')"
        )
    return argv


__all__ = [
    "PRESETS",
    "ComparePreset",
    "CompareOptions",
    "Figure",
    "ServerProcess",
    "Target",
    "Variant",
    "figure_value",
    "figure_values",
    "format_result",
    "format_table",
    "free_port",
    "ratio",
    "run_compare",
    "serve_command_from_string",
]
