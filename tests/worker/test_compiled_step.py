"""``--compile``: decode steps through compiled graphs give the eager engine's tokens,
with float and 8-bit KV caches (one file, so one process pays inductor's first-compile
start-up once)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from kvserve.model.loader import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.mark.slow
def test_compiled_decode_buckets_match_eager(tokenizer, tmp_path, monkeypatch) -> None:
    """Compiled steps give eager's greedy tokens, every bucket is warmed at startup,
    and no compiled kernel walks a whole layer's KV cache (the cache is written where
    it lies, not copied and copied back each step)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold compile
    common = dict(
        dtype="float32",
        max_model_len=256,
        scheduler_policy="separated",
        max_num_seqs=2,
        num_seqs_buckets=(1, 2),
        max_num_batched_tokens=128,
        num_batched_tokens_buckets=(64, 128),
        max_step_ms=0,  # no startup calibration steps: count only the compile warm-up
        quantization="none",
    )
    prompts = [
        tokenizer.encode("The capital of France is"),
        tokenizer.encode("def fibonacci(n):\n    if n < 2:"),
        tokenizer.encode("Once upon a time"),
    ]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = LLM(**common).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    llm = LLM(compile=True, **common)
    compiled = llm.engine.runner.compiled  # type: ignore[attr-defined]
    assert compiled is not None and compiled.buckets == (1, 2)
    warm = compiled.num_calls
    assert warm == 2, "every decode bucket is compiled and run at startup"
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert compiled.num_calls > warm, "decode steps ran through the compiled graphs"
    for a, b in zip(eager, outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    llm.engine.check_no_leaks()
    code = "\n".join(p.read_text() for p in tmp_path.rglob("*.py"))
    assert "def call(" in code and "kvserve.write_kv_and_attend" in code
    layer_cache = llm.engine.runner.kv_caches[0]  # type: ignore[attr-defined]
    assert f"{layer_cache.numel()}L" not in code, "a compiled kernel copies a layer's cache"


def test_compile_needs_the_native_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_ATTENTION", "portable")
    with pytest.raises(ValueError, match="--compile needs the native attention kernel"):
        LLM(compile=True, dtype="float32", max_model_len=256)


def _same_greedy_or_near_tie(eager, compiled) -> None:
    """Compiled greedy tokens equal eager's up to the first difference, and there the
    two tokens were a near tie in eager's own logprobs (inductor fuses float32 norms in
    another order; on an Intel AMX CPU, 2026-12-05, the int8 cache flipped a 0.078-nat tie at token 5).
    A broken kernel diverges by far more than that margin."""
    a, b = list(eager.token_ids), list(compiled.token_ids)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            top = eager.logprobs[i]
            assert y in top, f"token {i}: compiled {y} not in eager's top-2 {list(top)}"
            gap = top[x].logprob - top[y].logprob
            assert 0.0 <= gap < 0.15, f"token {i}: eager prefers {x} by {gap:.4f} nats"
            return


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread_torch")  # the 8-bit engine tests' setting; file's end
@pytest.mark.parametrize("kv_name", ["int8", "fp8_e4m3"])
def test_compile_with_8bit_kv_reads_the_cache_in_place(kv_name, tokenizer, tmp_path, monkeypatch):
    """--compile with an 8-bit cache: compiled decode steps give the eager 8-bit
    engine's greedy tokens, through the one in-place operator (the compiled code calls
    kvserve.kv8_write_and_attend and never copies a layer's cache)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold compile
    tok = tokenizer
    common = dict(
        dtype="float32",
        kv_cache_dtype=kv_name,
        max_model_len=256,
        scheduler_policy="separated",
        max_num_seqs=2,
        # one decode bucket, one graph to compile (the two prompts decode together); the
        # bucket machinery itself is tests/worker/test_compiled_step.py's
        num_seqs_buckets=(2,),
        max_num_batched_tokens=128,
        num_batched_tokens_buckets=(64, 128),
        max_step_ms=0,
        num_kv_blocks=64,
    )
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    eager = LLM(**common).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    llm = LLM(compile=True, **common)
    compiled = llm.engine.runner.compiled  # type: ignore[attr-defined]
    assert compiled is not None
    warm = compiled.num_calls
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert compiled.num_calls > warm, "decode steps ran through the compiled graphs"
    for a, b in zip(eager, outs, strict=True):
        _same_greedy_or_near_tie(a.outputs[0], b.outputs[0])
    llm.engine.check_no_leaks()
    code = "\n".join(p.read_text() for p in tmp_path.rglob("*.py"))
    assert "def call(" in code and "kvserve.kv8_write_and_attend" in code
    layer_cache = llm.engine.runner.kv_caches[0]  # type: ignore[attr-defined]
    assert f"{layer_cache.numel()}L" not in code, "a compiled kernel copies a layer's cache"
