"""The engine with an 8-bit KV cache: option validation, capacity and the memory report,
no leaked block with a tight cache, prefix sharing and aborts, and a request's tokens
bitwise the same alone or in a batch (batch-invariant mode). ``--compile`` with an 8-bit
cache: tests/worker/test_compiled_step.py."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from kvserve.engine.args import build_engine_config
from kvserve.entrypoints.llm import LLM
from kvserve.request import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread_torch")


def test_bad_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match=r"invalid kv_cache_dtype='int4'.*int8.*for example"):
        build_engine_config(kv_cache_dtype="int4")
    for ok in ("auto", "bfloat16", "float32", "int8", "fp8_e4m3", "fp8"):
        assert build_engine_config(kv_cache_dtype=ok).cache.kv_cache_dtype == ok


def test_cli_refuses_a_bad_kv_cache_dtype():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.entrypoints.cli",
            "generate",
            "--prompt",
            "x",
            "--kv-cache-dtype",
            "q4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "kv_cache_dtype='q4'" in proc.stderr and "int8" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_float_kv_dtype_must_match_the_model_dtype():
    with pytest.raises(ValueError, match="float KV cache holds the model dtype"):
        LLM(dtype="bfloat16", kv_cache_dtype="float32", kv_cache_memory_gib=0.01)


@pytest.fixture(scope="module")
def int8_llm():
    return LLM(
        dtype="bfloat16",
        kv_cache_dtype="int8",
        num_kv_blocks=40,  # tight: requests wait for blocks
        max_num_batched_tokens=96,
        max_num_seqs=6,
        batch_invariant=True,
    )


def test_capacity_and_memory_report():
    from kvserve.model.memory import memory_report

    gib = 0.02
    nb: dict[str, int] = {}
    fingerprints: dict[str, str] = {}
    for kv_dtype, name in (("auto", "bfloat16"), ("int8", "int8"), ("fp8_e4m3", "fp8_e4m3")):
        llm = LLM(dtype="bfloat16", kv_cache_dtype=kv_dtype, kv_cache_memory_gib=gib)
        nb[name] = llm.engine.runner.num_kv_blocks
        fingerprints[name] = llm.engine.kv_cache_manager.model_fingerprint
        cfg = llm.engine.loaded.model.config
        report = memory_report(llm.engine)
        assert report.kv_format == name and report.kv_blocks == nb[name]
        assert report.kv <= gib * (1 << 30) and report.kv > 0.95 * gib * (1 << 30)
        assert f"({name}, " in report.describe()
        del llm  # one engine at a time: the next one may reuse its model load
    d = cfg.head_dim
    # blocks grow by the row-bytes ratio: 2 D bytes (bf16) vs D + 4 (codes + fp32 scale)
    assert (
        nb["int8"]
        == nb["fp8_e4m3"]
        == int(gib * (1 << 30)) // (2 * cfg.num_layers * 16 * cfg.num_kv_heads * (d + 4))
    )
    assert nb["int8"] / nb["bfloat16"] == pytest.approx(2 * d / (d + 4), rel=0.02)
    assert fingerprints["bfloat16"] != fingerprints["int8"]


def test_no_leaks_with_a_tight_cache_sharing_and_aborts(int8_llm):
    engine = int8_llm.engine
    tok = int8_llm.tokenizer
    rng = random.Random(0)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
    ]
    shared = " ".join(rng.choice(words) for _ in range(60))
    for round_ in range(3):
        ids = []
        for i in range(6):
            text = (shared if i % 2 else "") + " ".join(rng.choice(words) for _ in range(40))
            rid = f"r{round_}-{i}"
            engine.add_request(
                tok(text)["input_ids"],
                SamplingParams(max_tokens=12, temperature=0.0),
                request_id=rid,
            )
            ids.append(rid)
        for step in range(400):
            if not engine.has_unfinished_requests():
                break
            engine.step()
            if step == 3:
                engine.abort_requests(ids[1])
        assert not engine.has_unfinished_requests()
        engine.check_no_leaks()


def test_tokens_do_not_depend_on_the_batch(int8_llm):
    prompts = [
        "The capital of France is",
        "Write a haiku about the sea:",
        "def add(a, b):",
        "List three colors: red,",
    ]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    together = [o.outputs[0].token_ids for o in int8_llm.generate(prompts, params)]
    alone = [int8_llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    int8_llm.engine.check_no_leaks()
