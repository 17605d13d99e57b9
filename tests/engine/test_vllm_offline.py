"""vLLM's offline API shapes on kvserve's LLM: the quick-start with only the import
changed, vLLM's engine kwargs, prompt dicts, chat options, logprobs as
dict[int, Logprob], allowed_token_ids / bad_words / truncate_prompt_tokens, the
old guided_decoding name, and the engine-wide seed."""

from __future__ import annotations

import json

import pytest

from kvserve import LLM, GuidedDecodingParams, Logprob, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def llm() -> LLM:
    # vLLM-only kwargs are accepted with notices
    return LLM(
        model="smollm2-135m-instruct",
        seed=0,
        tensor_parallel_size=1,
        enforce_eager=True,
        trust_remote_code=True,
        num_kv_blocks=256,
        max_model_len=1024,
    )


def test_vllm_quickstart_runs_with_only_the_import_changed(llm: LLM) -> None:
    # (vLLM's docs: prompts, SamplingParams(temperature=0.8, top_p=0.95), generate, outputs)
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        assert isinstance(prompt, str) and generated_text
    assert [o.prompt for o in outputs] == prompts


def test_unhonourable_vllm_kwargs_name_the_alternative() -> None:
    with pytest.raises(ValueError, match="--replicas"):
        LLM(model="smollm2-135m-instruct", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model="smollm2-135m-instruct", tokenizer="/some/other/tokenizer")


def test_prompt_dicts_anywhere(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0)
    ids = llm.tokenizer.encode("The capital of France is")
    outs = llm.generate(
        [
            "The capital of France is",
            {"prompt": "The capital of France is"},
            {"prompt_token_ids": ids},
        ],
        params,
        use_tqdm=False,
    )
    assert len({o.outputs[0].text for o in outs}) == 1
    assert outs[2].prompt is None and outs[2].prompt_token_ids == ids
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate([{"prompt": "x", "multi_modal_data": {}}], params)


def test_chat_template_tools_and_content_parts(llm: LLM) -> None:
    params = SamplingParams(max_tokens=3, temperature=0)
    plain = llm.chat([{"role": "user", "content": "Hi there"}], params, use_tqdm=False)[0]
    parts = llm.chat(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
            }
        ],
        params,
        use_tqdm=False,
    )[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids
    template = "{% for m in messages %}{{ m['content'] }}|{{ tools | length }}|{{ x }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    out = llm.chat(
        [{"role": "user", "content": "Q"}],
        params,
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"x": "kw"},
        tools=tools,
    )[0]
    assert out.prompt == "Q|1|kw"
    with pytest.raises(ValueError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_logprobs_in_vllms_shape(llm: LLM) -> None:
    out = llm.generate(
        ["The capital of France is"],
        SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == 3
    for tid, pos in zip(comp.token_ids, comp.logprobs, strict=True):
        assert isinstance(pos, dict) and tid in pos
        lp = pos[tid]
        assert isinstance(lp, Logprob) and lp.rank == 1  # greedy: the top token
        assert lp.decoded_token == llm.tokenizer.decode([tid])
        assert lp.logprob == pos.sampled_logprob <= 0  # kvserve's attributes kept
        assert len(pos) <= 3 and all(v.rank is not None for v in pos.values())
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    first = out.prompt_logprobs[1]
    assert first is not None and out.prompt_token_ids[1] in first


def test_allowed_token_ids_bad_words_and_truncation(llm: LLM) -> None:
    tok = llm.tokenizer
    allowed = tok.encode(" yes no", add_special_tokens=False)
    out = llm.generate(
        ["Answer:"],
        SamplingParams(max_tokens=5, temperature=1.0, seed=3, allowed_token_ids=allowed),
        use_tqdm=False,
    )[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)

    prompt = "The capital of France is"
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    word = greedy[0].outputs[0].text.split()[0]
    banned = llm.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0, bad_words=[word]), use_tqdm=False
    )[0].outputs[0]
    assert word not in banned.text.split()

    long_ids = tok.encode("one two three four five six seven eight")
    cut = llm.generate(
        [{"prompt_token_ids": long_ids}],
        SamplingParams(max_tokens=1, temperature=0, truncate_prompt_tokens=3),
        use_tqdm=False,
    )[0]
    assert cut.prompt_token_ids == long_ids[-3:]


def test_guided_decoding_old_name_and_export(llm: LLM) -> None:
    assert GuidedDecodingParams is StructuredOutputsParams
    out = llm.generate(
        ["Pick a color:"],
        SamplingParams(
            max_tokens=20,
            temperature=0,
            guided_decoding=GuidedDecodingParams(choice=["red", "blue"]),
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text in ("red", "blue")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    out = llm.generate(
        ["A number as JSON:"],
        SamplingParams(
            max_tokens=20, temperature=0, structured_outputs=StructuredOutputsParams(json=schema)
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert isinstance(json.loads(out.text)["n"], int)


def test_engine_seed_makes_unseeded_sampling_reproducible(llm: LLM) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0)
    llm._seeds.seed(5)  # type: ignore[union-attr]
    a = [o.outputs[0].text for o in llm.generate(["Once upon a time"] * 2, params, use_tqdm=False)]
    llm._seeds.seed(5)  # type: ignore[union-attr]
    b = [o.outputs[0].text for o in llm.generate(["Once upon a time"] * 2, params, use_tqdm=False)]
    assert a == b
    llm.engine.check_no_leaks()
