"""The request surface on the real default model (fp32), offline: n and best_of over
shared prompt blocks, prompt logprobs against HF transformers (also after a
prefix-cache hit and across prefill chunks), structured outputs, logit_bias."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.structured.params import StructuredOutputsParams  # noqa: E402

pytestmark = pytest.mark.model

BLOCK = 16
PROMPT = (
    "The lighthouse keeper wrote in the logbook every evening: the weather, the ships that "
    "passed, the state of the lamp and the tide. On the night of the storm he wrote"
)


@pytest.fixture(scope="module")
def llm(single_thread_torch: None) -> LLM:
    # 64-token steps: longer prompts are computed in chunks
    return LLM(
        dtype="float32",
        quantization="none",  # HF logprob parity pins float32 dequantized
        max_model_len=1024,
        num_kv_blocks=256,
        max_num_batched_tokens=64,
    )


class _CountingRunner:
    """Wraps the model runner and counts the tokens each request computes."""

    def __init__(self, runner: object) -> None:
        self.runner = runner
        self.computed: dict[str, int] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.runner, name)

    def execute_model(self, so):  # type: ignore[no-untyped-def]
        for req_id, n in so.num_scheduled_tokens.items():
            self.computed[req_id] = self.computed.get(req_id, 0) + n
        return self.runner.execute_model(so)


def test_n_samples_share_the_prompt(llm: LLM) -> None:
    engine = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    counting = _CountingRunner(engine.runner)
    engine.runner = counting  # type: ignore[assignment]
    try:
        req_id = engine.add_request(ids, params)
        while not any(r.startswith(req_id) for r in counting.computed):
            engine.step()
        # the prompt step forked every sample: prompt blocks once, one partial block each
        full, partial = divmod(len(ids), BLOCK)
        assert engine.kv_cache_manager.num_active_blocks == full + 4 * (partial > 0)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.runner = counting.runner  # type: ignore[assignment]
    # prompt computed once; each sample then computes its own outputs but the last
    assert counting.computed[req_id] == len(ids) + 11
    assert all(counting.computed[f"{req_id}#{i}"] == 11 for i in (1, 2, 3))
    engine.check_no_leaks()

    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    again = llm.generate([PROMPT], params, use_tqdm=False)[0]
    single = llm.generate([PROMPT], SamplingParams(**{**_kw(params), "n": 1}), use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len(set(texts)) == 4  # distinct streams
    assert texts == [c.text for c in again.outputs]  # reproducible from the seed
    assert texts[0] == single.outputs[0].text  # sample 0 draws what n=1 draws


def _kw(params: SamplingParams) -> dict[str, object]:
    return {k: getattr(params, k) for k in ("temperature", "seed", "max_tokens", "ignore_eos")}


def test_abort_frees_every_sample(llm: LLM) -> None:
    engine = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    req_id = engine.add_request(ids, SamplingParams(n=8, temperature=1.0, max_tokens=200))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.num_running == 8
    deltas = engine.abort_requests([req_id] + [f"{req_id}#{i}" for i in range(1, 8)])
    assert len(deltas) == 8 and all(d.finish_reason == "abort" for d in deltas)
    assert engine.kv_cache_manager.num_active_blocks == 0
    engine.check_no_leaks()


def test_best_of_keeps_the_most_likely(llm: LLM) -> None:
    out = llm.generate(
        [PROMPT],
        SamplingParams(n=2, best_of=5, temperature=1.0, seed=5, max_tokens=6),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None and c.cumulative_logprob is not None for c in out.outputs)
    everything = llm.generate(
        [PROMPT],
        SamplingParams(n=5, temperature=1.0, seed=5, max_tokens=6, logprobs=0),
        use_tqdm=False,
    )[0]
    ranked = sorted(everything.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))
    assert {c.text for c in out.outputs} == {c.text for c in ranked[:2]}
    llm.engine.check_no_leaks()


def test_prompt_logprobs_match_hf_also_after_a_prefix_hit(llm: LLM, hf_model) -> None:
    ids = llm.tokenizer.encode(PROMPT + " " + PROMPT)  # > 64 tokens: several prefill chunks
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
    top2 = ref[:-1].topk(2, dim=-1)

    llm.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # such a request computes its whole prompt
    got = out.prompt_logprobs
    assert got is not None and got[0] is None and len(got) == len(ids)
    errors = [abs(lp.sampled_logprob - w) for lp, w in zip(got[1:], want, strict=True)]  # type: ignore[union-attr]
    assert max(errors) < 1e-3, max(errors)
    for p, lp in enumerate(got[1:]):
        assert lp is not None and lp.top_token_ids == top2.indices[p].tolist()
        assert lp.rank == int((ref[p] > ref[p, ids[p + 1]]).sum()) + 1

    # a later request without prompt logprobs hits the cache as usual
    hit = llm.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False
    )
    assert hit[0].num_cached_tokens == (len(ids) - 1) // BLOCK * BLOCK
    llm.engine.check_no_leaks()


def test_json_schema_output_parses_and_validates(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["name", "year"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        n=2,
        temperature=0.8,
        seed=2,
        max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    out = llm.chat(
        [{"role": "user", "content": "Name a famous ship and the year it sank."}],
        params,
        use_tqdm=False,
    )[0]
    for comp in out.outputs:
        data = json.loads(comp.text)
        assert set(data) == {"name", "year"} and isinstance(data["name"], str)
        assert isinstance(data["year"], int) and comp.finish_reason == "stop"
    choice = SamplingParams(
        temperature=1.0,
        seed=1,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["red", "blue"]),
    )
    assert llm.generate(["My favourite colour is"], choice, use_tqdm=False)[0].outputs[0].text in (
        "red",
        "blue",
    )
    llm.engine.check_no_leaks()


def test_within_max_tokens_closes_every_sample(llm: LLM) -> None:
    """``within_max_tokens`` through the model runner (forks of n=3 included, logprobs
    of replaced tokens): every sample of a runaway-inducing prompt ends as JSON that
    validates, within max_tokens; a max_tokens below the shortest is refused."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"title": {"type": "string"}, "text": {"type": "string"}},
        "required": ["title", "text"],
        "additionalProperties": False,
    }
    so = StructuredOutputsParams(json=schema, within_max_tokens=True)
    ask = [{"role": "user", "content": "Write the full text of a 5000 word novel as JSON."}]
    with pytest.raises(ValueError, match="max_tokens >= ") as e:
        llm.chat(ask, SamplingParams(max_tokens=1, structured_outputs=so), use_tqdm=False)
    least = int(str(e.value).split("max_tokens >= ")[1].split(",")[0])
    for max_tokens in (least, least + 4, 30):
        params = SamplingParams(
            n=3, temperature=1.2, seed=5, max_tokens=max_tokens, logprobs=0, structured_outputs=so
        )
        out = llm.chat(ask, params, use_tqdm=False)[0]
        for comp in out.outputs:
            assert len(comp.token_ids) <= max_tokens
            jsonschema.validate(json.loads(comp.text), schema)
            assert comp.finish_reason == "stop"
            assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
            assert all(pos.sampled_logprob <= 0 for pos in comp.logprobs)
    llm.engine.check_no_leaks()


def test_logit_bias(llm: LLM) -> None:
    token = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, logit_bias={token: 100.0})
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == [token] * 3
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([PROMPT], SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101.0})
