"""``--compile``: decode steps through compiled graphs give the eager engine's tokens."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams


@pytest.mark.slow
def test_compiled_decode_buckets_match_eager(small_model_dir, tmp_path, monkeypatch) -> None:
    """Compiled steps give eager's greedy tokens, every bucket is warmed at startup,
    and no compiled kernel walks a whole layer's KV cache (the cache is written where
    it lies, not copied and copied back each step). On a 2-layer model of the default
    model's layout (head_dim 64, GQA 3:1, tied embeddings): the subject is the compiled
    step, and a cold compile of its graph takes ~18 s against ~40 s for 30 layers."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold compile
    common = dict(
        model=str(small_model_dir),
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
    prompts = [[5, 17, 300, 41, 9], [77, 3, 12, 900, 450, 11, 2, 64, 64], [600, 601]]
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
    code = "\n".join(p.read_text() for p in (tmp_path / "inductor").rglob("*.py"))
    assert "def call(" in code and "kvserve.write_kv_and_attend" in code
    layer_cache = llm.engine.runner.kv_caches[0]  # type: ignore[attr-defined]
    assert f"{layer_cache.numel()}L" not in code, "a compiled kernel copies a layer's cache"


def test_compile_needs_the_native_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_ATTENTION", "portable")
    with pytest.raises(ValueError, match="--compile needs the native attention kernel"):
        LLM(compile=True, dtype="float32", max_model_len=256)
