"""Structured outputs below the engine: constraint params, the grammar compiler (one
compilation per distinct constraint, invalid ones refused naming the field) and the
token masks that keep a sampled text inside its grammar."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from kvserve.request import RequestError, SamplingParams
from kvserve.structured.bitmask import unpack_bitmask
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.matcher import StructuredBatch
from kvserve.structured.params import StructuredOutputsParams


def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("b",))
    with pytest.raises(RequestError) as e:
        StructuredOutputsParams(json="{not json")
    assert e.value.param == "structured_outputs.json"
    assert StructuredOutputsParams(choice=["a"]).choice == ("a",)
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).key() == StructuredOutputsParams(
        json='{"a": 2, "b": 1}'
    ).key()[:1] + (json.dumps({"a": 2, "b": 1}, sort_keys=True),)


def test_compiled_once_and_cached(compiler: GrammarCompiler) -> None:
    before = compiler.num_compiled
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    for _ in range(3):
        compiler.check(StructuredOutputsParams(json=dict(schema)))
    compiler.matcher(StructuredOutputsParams(json=dict(schema)))
    assert compiler.num_compiled == before + 1


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json"),
        (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    ],
)
def test_invalid_constraint_is_refused_naming_it(
    compiler: GrammarCompiler, params: StructuredOutputsParams, field: str
) -> None:
    with pytest.raises(RequestError) as e:
        compiler.check(params)
    assert e.value.param == field and "invalid" in str(e.value)


def _walk(batch: StructuredBatch, tokenizer: Any, req_id: str, seed: int) -> str:
    """Draw allowed tokens at random (EOS as soon as it is allowed, blank tokens only
    when nothing else is) and return the text: whatever the mask lets through."""
    gen = torch.Generator().manual_seed(seed)
    eos = batch.compiler.eos_token_id
    out: list[int] = []
    texts: dict[int, str] = {}
    for _ in range(300):
        pending = batch.start_masks([req_id])
        assert pending is not None
        mask = pending.result()
        allowed = mask[0].nonzero().flatten().tolist()
        if eos in allowed:
            return str(tokenizer.decode(out))
        solid = [t for t in allowed[:512] if texts.setdefault(t, tokenizer.decode([t])).strip()]
        pool = solid or allowed
        token = pool[int(torch.randint(len(pool), (1,), generator=gen))]
        batch.accept(req_id, token)
        out.append(token)
    raise AssertionError(f"no end after 300 tokens: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize(
    ("params", "valid"),
    [
        (
            StructuredOutputsParams(choice=("yes", "no", 'a "q"')),
            lambda t: t in ("yes", "no", 'a "q"'),
        ),
        (
            StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t),
        ),
        (
            StructuredOutputsParams(grammar='root ::= "x" [0-9]'),
            lambda t: re.fullmatch(r"x[0-9]", t),
        ),
        (
            StructuredOutputsParams(
                json={
                    "type": "object",
                    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                    "required": ["n", "ok"],
                    "additionalProperties": False,
                }
            ),
            lambda t: set(json.loads(t)) == {"n", "ok"},
        ),
    ],
)
def test_masks_keep_random_walks_inside_the_grammar(
    compiler: GrammarCompiler, tokenizer: Any, params: StructuredOutputsParams, valid: Any
) -> None:
    batch = StructuredBatch(compiler)
    for seed in range(3):
        batch.add("r", SamplingParams(structured_outputs=params), [])
        text = _walk(batch, tokenizer, "r", seed)
        assert valid(text), text
        batch.drop("r")


def test_replayed_tokens_and_unconstrained_rows(compiler: GrammarCompiler, tokenizer: Any) -> None:
    batch = StructuredBatch(compiler)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=("hello world",)))
    prefix = tokenizer.encode("hello", add_special_tokens=False)
    batch.add("r", params, prefix)  # e.g. after a preemption: the outputs so far replay
    batch.add("free", SamplingParams(), [])  # no constraint: not tracked
    pending = batch.start_masks(["free", "r"])
    assert pending is not None
    mask = pending.result()
    assert bool(mask[0].all())
    allowed = [tokenizer.decode([t]) for t in mask[1].nonzero().flatten().tolist()]
    assert allowed and all(" world".startswith(a) for a in allowed)
    assert batch.start_masks(["free"]) is None


def test_unpack_bitmask() -> None:
    words = torch.tensor([[0b101, 1 << 31 >> 31 & 0], [-1, 1]], dtype=torch.int32)
    bits = unpack_bitmask(words, 40)
    assert bits[0].nonzero().flatten().tolist() == [0, 2]
    assert bits[1].sum() == 33 and bool(bits[1, 32]) and not bool(bits[1, 33])
