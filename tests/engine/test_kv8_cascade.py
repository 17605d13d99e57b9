"""An 8-bit KV cache with shared prefixes long enough for cascade attention: the
metadata gives no cascade split (the int8 kernel reads the shared blocks in place for
every row), and the tokens equal each request run alone (the fallback is correct)."""

from __future__ import annotations

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.model.attention_metadata import CASCADE_MIN_SHARED_TOKENS
from kvserve.request import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.mark.slow
def test_shared_prefix_with_int8_kv_needs_no_cascade_and_matches_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = LLM(
        dtype="bfloat16", kv_cache_dtype="int8", kv_cache_memory_gib=0.02, batch_invariant=True
    )
    tok = llm.tokenizer
    shared = "In the beginning the committee wrote down every rule it could think of. " * 12
    assert len(tok(shared)["input_ids"]) >= 2 * CASCADE_MIN_SHARED_TOKENS
    prompts = [shared + tail for tail in ("First,", "Second,", "Then the chair said", "Finally")]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    seen: list[object] = []  # with bf16 KV this workload cascade-splits 7 of 30 steps
    from kvserve.model import attention_metadata as am

    real = am.cascade_split

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(am, "cascade_split", spy)  # raises if the function moved
    llm.generate(prompts[:1], params)  # the prefix is cached; later requests share it
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.undo()
    assert seen == [], "an int8 cache must not be split for cascade attention"
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    assert all(len(t) == 8 for t in together)
    llm.engine.check_no_leaks()
