"""`kvserve bench compare`: presets, table/ratio printing, server lifecycle, HF baseline.

The server lifecycle runs against the fake OpenAI-compatible server started as a
subprocess in place of `kvserve serve` (a test double for the HTTP protocol only).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from kvserve.bench.compare import (
    PRESETS,
    CompareOptions,
    ComparePreset,
    Figure,
    ServerProcess,
    Target,
    Variant,
    figure_value,
    format_result,
    format_table,
    free_port,
    ratio,
    run_compare,
)
from kvserve.bench.disagg import TRANSFER_FIGURES, transfer_figures
from kvserve.bench.metrics import summarize
from kvserve.bench.workloads import WordVocabulary, WorkloadSpec, build_workload

FAKE_SERVER = str(Path(__file__).parent.parent / "support" / "bench_fake_server.py")


def test_ratio_and_target_check() -> None:
    assert ratio(2.0, 8.0) == 0.25
    assert ratio(None, 8.0) is None and ratio(1.0, 0.0) is None
    t = Target("mean_ttft_ms", "on", "off", 0.2, at_most=True)
    assert t.check({"on": {"mean_ttft_ms": 10.0}, "off": {"mean_ttft_ms": 100.0}}) == (0.1, True)
    assert t.check({"on": {"mean_ttft_ms": 30.0}, "off": {"mean_ttft_ms": 100.0}}) == (0.3, False)
    assert t.check({"on": {"mean_ttft_ms": None}, "off": {"mean_ttft_ms": 100.0}}) == (None, None)
    up = Target("output_throughput", "kv", "hf", 2.5, at_most=False)
    assert up.check({"kv": {"output_throughput": 300.0}, "hf": {"output_throughput": 100.0}}) == (
        3.0,
        True,
    )


def test_format_table_values_and_ratios() -> None:
    figures = (Figure("mean_ttft_ms", "mean TTFT ms"), Figure("output_throughput", "tok/s", True))
    values = {
        "off": {"mean_ttft_ms": 200.0, "output_throughput": 50.0},
        "on": {"mean_ttft_ms": 20.0, "output_throughput": 5.0},
        "broken": {"mean_ttft_ms": None, "output_throughput": None},
    }
    assert format_table(values, figures, "off").splitlines() == [
        "| variant | mean TTFT ms | tok/s |",
        "| --- | --- | --- |",
        "| off | 200.0 (ref) | 50.0 (ref) |",
        "| on | 20.0 (0.10x) | 5.000 (0.10x) |",
        "| broken | n/a | n/a |",
    ]
    with pytest.raises(ValueError, match="--reference"):
        format_table(values, figures, "nope")


def test_figure_value_reads_summary_and_tags() -> None:
    report = {
        "summary": {"mean_ttft_ms": 5.0, "goodput": None},
        "by_tag": {"decode": {"p99_itl_ms": 7.0}},
    }
    assert figure_value(report, "mean_ttft_ms") == 5.0
    assert figure_value(report, "decode/p99_itl_ms") == 7.0
    assert figure_value(report, "prefill/p99_itl_ms") is None
    assert figure_value(report, "goodput") is None


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_consistent(name: str) -> None:
    preset = PRESETS[name]
    names = [v.name for v in preset.variants]
    assert len(set(names)) == len(names) and preset.reference in names
    if preset.target:
        assert preset.target.variant in names and preset.target.reference in names
        assert preset.target.figure in [f.key for f in preset.figures]
    w = build_workload(preset.workload)
    summary_keys = set(summarize([], 1.0)) | {"prefix_cache_hit_rate", *TRANSFER_FIGURES}
    tags = {s.tag for s in w.sessions}
    for f in preset.figures:
        tag, _, key = f.key.rpartition("/")
        assert key in summary_keys
        assert not tag or tag in tags


def test_issue_preset_sizes() -> None:
    prefix = PRESETS["prefix"].workload
    assert (
        prefix.kind,
        prefix.prefix_len,
        prefix.input_len,
        prefix.output_len,
        prefix.num_requests,
    ) == (
        "shared-prefix",
        1024,
        64,
        64,
        32,
    )
    chunking = PRESETS["chunking"]
    assert chunking.workload.num_decodes == 8 and chunking.workload.long_prompt_len == 2048
    budgets = {
        v.name: int(v.engine_args[v.engine_args.index("--max-num-batched-tokens") + 1])
        for v in chunking.variants
    }
    assert budgets["chunked-256"] == 256 and budgets["monolithic"] >= 2048 + 8
    throughput = PRESETS["throughput"]
    assert (
        throughput.workload.input_len,
        throughput.workload.output_len,
        throughput.max_concurrency,
    ) == (512, 128, 16)
    assert any(v.backend == "hf" for v in throughput.variants)


def test_server_process_not_healthy_raises_with_log(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-c", "import time; print('starting', flush=True); time.sleep(60)"]
    server = ServerProcess(cmd, tmp_path / "log.txt", port)
    with server, pytest.raises(RuntimeError, match="not healthy after"):
        server.wait_healthy(timeout_s=1.0)
    assert server.proc.returncode is not None  # stopped on exit
    assert "starting" in (tmp_path / "log.txt").read_text()


def _fake_server_options(tmp_path: Path) -> CompareOptions:
    """``bench compare`` against the fake server (tests/support/bench_fake_server.py),
    results under ``tmp_path / "cmp"``, no progress bar, no plots."""
    return CompareOptions(
        model="fake-model",
        output_dir=tmp_path / "cmp",
        serve_command=[sys.executable, FAKE_SERVER],
        startup_timeout_s=60,
        progress=False,
        plots=False,
    )


def _tiny_preset(variants: tuple[Variant, ...]) -> ComparePreset:
    return ComparePreset(
        name="tiny",
        description="fake server, two delays",
        workload=WorkloadSpec(
            kind="shared-prefix",
            num_requests=4,
            num_prefixes=1,
            prefix_len=10,
            input_len=3,
            output_len=4,
        ),
        variants=variants,
        reference="slow",
        figures=(
            Figure("mean_itl_ms", "mean ITL ms"),
            Figure("prefix_cache_hit_rate", "hit rate", True),
        ),
        max_concurrency=2,
        target=Target("mean_itl_ms", "fast", "slow", 1.0, at_most=True),
    )


def test_run_compare_against_fake_server_subprocesses(tmp_path: Path) -> None:
    preset = _tiny_preset(
        (
            Variant("slow", ("--delay-ms", "40")),
            Variant("fast", ("--delay-ms", "1")),
            Variant("dead", ("--exit-at-once",)),
        )
    )
    result = run_compare(preset, _fake_server_options(tmp_path), WordVocabulary.default())
    values = result["values"]
    assert values["slow"]["mean_itl_ms"] > values["fast"]["mean_itl_ms"] > 0
    assert values["fast"]["prefix_cache_hit_rate"] > 0
    assert values["dead"] == {"mean_itl_ms": None, "prefix_cache_hit_rate": None}
    assert "exited with code 3" in result["errors"]["dead"]
    assert result["target"]["met"] is True
    assert result["target"]["ratio"] == pytest.approx(
        values["fast"]["mean_itl_ms"] / values["slow"]["mean_itl_ms"]
    )
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["values"] == values
    fast = json.loads((tmp_path / "cmp" / "fast" / "results.json").read_text())
    assert fast["summary"]["completed"] == 4 and "--delay-ms" in fast["config"]["command"]
    assert (tmp_path / "cmp" / "dead" / "server.log").exists()
    printed = format_result(result)
    assert (
        "| slow |" in printed
        and "(ref)" in printed
        and "MET" in printed
        and "error in dead" in printed
    )


def test_run_compare_rejects_unknown_reference(tmp_path: Path) -> None:
    opts = CompareOptions(output_dir=tmp_path, reference="nope", progress=False)
    with pytest.raises(ValueError, match="--reference"):
        run_compare(_tiny_preset((Variant("slow"), Variant("fast"))), opts)


def test_hf_static_batching_baseline_on_a_tiny_random_llama() -> None:
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from kvserve.bench.hf_baseline import run_hf_baseline

    pieces = ["<pad>", "<eos>"] + [f" w{i}" for i in range(60)]
    backend = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    config = LlamaConfig(
        vocab_size=len(pieces),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompts = [" w1 w2 w3", " w4", " w5 w6", " w7 w8 w9 w10", " w11"]
    results, duration = run_hf_baseline(
        prompts, [5, 3, 5, 5, 2], model, tokenizer, batch_size=2, progress=False
    )
    assert [r.prompt_len for r in results] == [3, 1, 2, 4, 1]
    assert [r.output_tokens for r in results] == [5, 3, 5, 5, 2]
    assert all(not r.streamed and r.success and r.send_time == 0.0 for r in results)
    ends = [r.end_time for r in results]
    assert ends[0] == ends[1] and ends[2] == ends[3]  # a batch returns together
    assert ends[1] <= ends[2] <= ends[4] <= duration
    assert all(r.ttft == r.e2e for r in results)
    s = summarize(results, duration)
    assert s["output_throughput"] == pytest.approx(20 / duration)
    assert s["mean_tpot_ms"] is None and not math.isnan(s["mean_ttft_ms"])
    with pytest.raises(ValueError, match="one per prompt"):
        run_hf_baseline(prompts, [1], model, tokenizer)


def test_disagg_variant_starts_a_prefill_worker_beside_its_decode_worker(tmp_path: Path) -> None:
    preset = _tiny_preset(
        (
            Variant("slow", ("--delay-ms", "40"), threads=2),
            Variant(
                "fast", ("--delay-ms", "1"), threads=1, prefill_args=("--no-kv-stream-chunks",)
            ),
        )
    )
    result = run_compare(preset, _fake_server_options(tmp_path), WordVocabulary.default())
    assert not result["errors"] and result["values"]["fast"]["mean_itl_ms"] > 0
    fast = json.loads((tmp_path / "cmp" / "fast" / "results.json").read_text())
    command = fast["config"]["command"]
    assert command[command.index("--kv-role") + 1] == "decode" and "--kv-prefill-peers" in command
    assert fast["config"]["threads"] == 1 and (tmp_path / "cmp" / "fast" / "prefill.log").exists()
    # The fake server has no transfer series: the figures are there, unmeasured.
    assert fast["summary"]["kv_hidden_share"] is None
    assert not (tmp_path / "cmp" / "slow" / "prefill.log").exists()


def test_transfer_figures_arithmetic() -> None:
    decode = {
        "kvserve:kv_transfer_bytes_total{direction=received}": 4_000_000.0,
        "kvserve:kv_transfer_busy_seconds_total": 2.0,
        "kvserve:kv_transfer_long_busy_seconds_total": 1.0,
        "kvserve:kv_transfer_long_exposed_seconds_total": 0.25,
        "kvserve:prompt_tokens_by_source_total{source=external_kv_transfer}": 200.0,
        "kvserve:kv_transfer_nominal_bytes_per_token": 20_000.0,
    }
    fig = transfer_figures(decode, {"kvserve:kv_transfer_bytes_total{direction=sent}": 4e6})
    assert fig["kv_transfer_mb_per_s"] == 2.0 and fig["kv_hidden_share"] == 0.75
    assert fig["kv_bytes_per_token"] == 20_000.0 == fig["kv_nominal_bytes_per_token"]
    assert fig["kv_bytes_sent"] == 4e6
    assert transfer_figures({}, {})["kv_hidden_share"] is None


def test_rounds_report_the_median_per_variant_and_figure() -> None:
    from kvserve.bench.compare import _median_values

    figures = (Figure("mean_itl_ms", "mean ITL ms"), Figure("p99_itl_ms", "p99 ITL ms"))
    rounds = [
        {"a": {"mean_itl_ms": 10.0, "p99_itl_ms": None}, "b": {"mean_itl_ms": 1.0}},
        {"a": {"mean_itl_ms": 30.0, "p99_itl_ms": 5.0}},
        {"a": {"mean_itl_ms": 20.0, "p99_itl_ms": 7.0}, "b": {"mean_itl_ms": 3.0}},
    ]
    values = _median_values(rounds, figures)
    assert values["a"] == {"mean_itl_ms": 20.0, "p99_itl_ms": 6.0}
    assert values["b"] == {"mean_itl_ms": 2.0, "p99_itl_ms": None}


def test_step_budget_presets_compare_old_and_new_defaults() -> None:
    for name in ("interference", "multiturn", "random-c16"):
        variants = {v.name: v.engine_args for v in PRESETS[name].variants}
        assert variants["new-default"] == ()
        assert variants["old-default"][-2:] == ("--max-step-ms", "0")
        assert "--prefill-budget-with-decodes" in variants["readme-flags"]
    assert PRESETS["interference"].request_rate == 3.0
    assert PRESETS["multiturn"].max_concurrency == 24
