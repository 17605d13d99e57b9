"""The peer harness's offline (OpenVINO GenAI vs kvserve) target and its table, without
OpenVINO installed: target and argument parsing, the driver's measuring and result
parsing on a fake engine, the table's rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import offline_driver  # noqa: E402
import openvino_peer  # noqa: E402
import peers  # noqa: E402


def test_parse_target() -> None:
    assert openvino_peer.parse_target("openvino:int4") == ("openvino", "int4", [])
    assert openvino_peer.parse_target("kvserve") == ("kvserve", "default", [])
    assert openvino_peer.parse_target("kvserve:quantization=none, dtype=float32") == (
        "kvserve",
        "quantization=none,dtype=float32",
        ["quantization=none", "dtype=float32"],
    )
    for bad in ("openvino:int2", "openvino", "kvserve:quantization", "vllm:bfloat16"):
        with pytest.raises(SystemExit):
            openvino_peer.parse_target(bad)
    assert openvino_peer.result_name("kvserve", "quantization=none,dtype=float32") == (
        "kvserve_quantization-none-dtype-float32.json"
    )


def test_make_prompts_deterministic_and_sized() -> None:
    a = openvino_peer.make_prompts(3, 50, 2, 20)
    assert a == openvino_peer.make_prompts(3, 50, 2, 20)
    assert len(a["batch"]) == 3 and len(a["single"]) == 2
    assert all(len(t.split()) == 50 for t in a["batch"])
    assert all(len(t.split()) == 20 for t in a["single"])
    assert len(set(a["batch"])) == 3


def _fake_engine(n_out: int, calls: list[int]):  # type: ignore[no-untyped-def]
    def generate(prompts: list[list[int]]) -> list[list[int]]:
        calls.append(len(prompts))
        return [[7] * n_out for _ in prompts]

    def encode(text: str) -> list[int]:
        return [len(w) for w in text.split()]

    return generate, encode


def test_measure_on_fake_engine() -> None:
    data = {"batch": ["a bb", "c", "d e f"], "single": ["x y", "z"], "max_tokens": 4}
    calls: list[int] = []
    gen, enc = _fake_engine(4, calls)
    r = offline_driver.measure(gen, enc, data, "fake", "f1")
    assert calls == [2, 3, 1, 1]  # warm-up of two, the batch, then one at a time
    assert r["batch_prompt_tokens"] == 6 and r["single_prompt_tokens"] == 3
    assert r["batch_output_tokens"] == 12 and r["batch_tok_s"] > 0 and r["single_tok_s"] > 0
    assert offline_driver.parse_result(json.dumps(r)) == r


def test_measure_refuses_short_outputs() -> None:
    data = {"batch": ["a"], "single": [], "max_tokens": 4}
    gen, enc = _fake_engine(3, [])
    with pytest.raises(RuntimeError, match="outputs of 4 tokens"):
        offline_driver.measure(gen, enc, data, "fake", "f1")


def test_parse_result_and_last_result() -> None:
    good = {k: 1 for k in offline_driver.RESULT_KEYS} | {"engine": "kvserve"}
    line = json.dumps(good)
    out = "INFO loading\n" + line + "\nbye\n"
    assert offline_driver.last_result(out)["engine"] == "kvserve"
    with pytest.raises(ValueError, match="no result line"):
        offline_driver.last_result("just logs\n")
    with pytest.raises(ValueError, match="lacks"):
        offline_driver.parse_result(json.dumps({"engine": "x"}))
    with pytest.raises(ValueError, match="positive rate"):
        offline_driver.parse_result(json.dumps(good | {"batch_tok_s": 0}))
    with pytest.raises(ValueError):
        offline_driver.parse_result("not json")


def _res(engine: str, fmt: str, batch: float, single: float, toks: int = 100) -> dict:  # type: ignore[type-arg]
    return {
        "engine": engine,
        "format": fmt,
        "batch_prompt_tokens": toks,
        "single_prompt_tokens": 10,
        "batch_tok_s": batch,
        "single_tok_s": single,
    }


def test_offline_table_ratios_and_token_note() -> None:
    rows = [_res("kvserve", "default", 200.0, 100.0), _res("openvino", "int8", 100.0, 125.0)]
    text = openvino_peer.offline_table(rows)
    ov = next(line for line in text.splitlines() if line.startswith("openvino:int8"))
    assert "0.50" in ov and "1.25" in ov
    assert "tokenized" not in text
    rows.append(_res("openvino", "int4", 90.0, 80.0, toks=101))
    assert "tokenized the prompts differently" in openvino_peer.offline_table(rows)
    assert openvino_peer.offline_table([]) == ""


def test_split_label() -> None:
    assert peers.split_label("rand_kvserve_bfloat16") == ("rand", "kvserve_bfloat16", "bfloat16")
    assert peers.split_label("multi_turn_vllm_float32_spec") == (
        "multi_turn",
        "vllm_float32_spec",
        "float32",
    )
    assert peers.split_label("startup") is None


def test_table_reads_every_section(tmp_path: Path) -> None:
    res = tmp_path / "results"
    res.mkdir()
    bench = {
        "output_throughput": 150.0,
        "mean_tpot_ms": 9.0,
        "p99_itl_ms": 20.0,
        "mean_ttft_ms": 50.0,
    }
    (res / "rand_vllm_bfloat16.json").write_text(json.dumps(bench))
    (res / "rand_kvserve_bfloat16_spec.json").write_text(
        json.dumps(bench | {"output_throughput": 300.0})
    )
    (res / "warm_kvserve_bfloat16.json").write_text(json.dumps(bench))
    (res / "notes_kvserve_bfloat16.json").write_text(json.dumps({"other": 1}))
    off = tmp_path / "offline"
    off.mkdir()
    (off / "prompts.json").write_text("{}")
    (off / "kvserve_default.json").write_text(json.dumps(_res("kvserve", "default", 200.0, 100.0)))
    (off / "openvino_int4.json").write_text(json.dumps(_res("openvino", "int4", 50.0, 50.0)))
    text = peers.table(peers.Layout(tmp_path))
    spec = next(line for line in text.splitlines() if "kvserve_bfloat16_spec" in line)
    assert "2.00" in spec  # the suffixed row is compared with vLLM's bfloat16 row
    assert "warm_" not in text and "notes" not in text
    assert "openvino:int4" in text and "0.25" in text


def test_offline_refuses_bad_targets_before_running(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="openvino formats"):
        peers.main(["--root", str(tmp_path), "offline", "kvserve", "openvino:fp8"])
    assert not (tmp_path / "offline").exists()
    with pytest.raises(SystemExit, match="max-tokens"):
        peers.main(["--root", str(tmp_path), "offline", "kvserve", "--max-tokens", "0"])
