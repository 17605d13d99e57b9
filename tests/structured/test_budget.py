"""Constrained outputs with ``within_max_tokens`` (forced tool calls) end as a complete,
valid output within ``max_tokens`` whatever the model writes: adversarial "models"
that run away inside a string or keep opening structure are walked through the
StructuredBatch exactly as the runner drives it (mask -> sample -> vet -> accept)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch

from kvserve.engine.validation import RequestLimits, validate_request
from kvserve.request import RequestError, SamplingParams
from kvserve.structured.budget import IN_STRING, OUT, ClosingTables, _effect, closing_plan
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.matcher import StructuredBatch
from kvserve.structured.params import StructuredOutputsParams

EMAIL = {
    "type": "object",
    "properties": {
        "to": {"type": "string"},
        "subject": {"type": "string"},
        "body": {"type": "string"},
        "cc": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["to", "subject", "body"],
    "additionalProperties": False,
}
PIZZA = {
    "type": "object",
    "properties": {
        "size": {"enum": ["small", "medium", "large"]},
        "toppings": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "n": {"type": "integer", "minimum": 1}},
            "required": ["street", "n"],
            "additionalProperties": False,
        },
        "note": {"type": "string", "minLength": 3},
    },
    "required": ["size", "toppings", "address", "note"],
    "additionalProperties": False,
}
# `required` over two tools, as kvserve.entrypoints.chat.tools builds it
REQUIRED = {
    "type": "array",
    "minItems": 1,
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": "send_email"}, "parameters": EMAIL},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"name": {"const": "order_pizza"}, "parameters": PIZZA},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            },
        ]
    },
}


@pytest.fixture(scope="module")
def texts(tokenizer: Any) -> list[str]:
    return [tokenizer.decode([i]) for i in range(49152)]


Chooser = Callable[[torch.Tensor, torch.Generator], int]


def _pick(pool: torch.Tensor, gen: torch.Generator) -> int:
    ids = pool.nonzero().flatten()
    return int(ids[int(torch.randint(len(ids), (1,), generator=gen))])


def _runaway(texts: list[str], eos: int) -> Chooser:
    """A model that never wants to stop: inside a string it writes letters, it never
    closes a string, an array or an object, and never ends, unless nothing else is
    allowed."""
    letters = torch.tensor([t.strip().isalpha() for t in texts])
    no_closer = torch.tensor([not any(c in t for c in '"]}') for t in texts])
    letters[eos] = no_closer[eos] = False

    def choose(mask: torch.Tensor, gen: torch.Generator) -> int:
        for pool in (mask & letters, mask & no_closer, mask):
            if bool(pool.any()):
                return _pick(pool, gen)
        raise AssertionError("nothing allowed")

    return choose


def _opener(texts: list[str], eos: int) -> Chooser:
    """A model that keeps opening structure: array items, new properties, new calls."""
    ids = {t: i for i, t in enumerate(texts)}
    wanted = [ids[w] for w in (',{"', ',"', '["', "[", ",{", ",", '{"', "{") if w in ids]
    no_quote = torch.tensor(['"' not in t for t in texts])
    no_quote[eos] = False

    def choose(mask: torch.Tensor, gen: torch.Generator) -> int:
        for t in wanted:
            if bool(mask[t]):
                return t
        pool = mask & no_quote
        return _pick(pool if bool(pool.any()) else mask, gen)

    return choose


def _generate(
    batch: StructuredBatch,
    compiler: GrammarCompiler,
    params: SamplingParams,
    choose: Chooser,
    seed: int,
    req_id: str = "r",
) -> tuple[list[int], int]:
    """Drive one request as the model runner does; returns (tokens, replaced count)."""
    assert params.max_tokens is not None
    gen = torch.Generator().manual_seed(seed)
    eos = compiler.eos_token_id
    batch.add(req_id, params, [])
    out: list[int] = []
    replaced = 0
    while len(out) < params.max_tokens:
        pending = batch.start_masks([req_id])
        assert pending is not None
        mask = pending.result()
        token = choose(mask[0], gen)
        forced = batch.vet(req_id, token)
        if forced is not None:
            assert bool(mask[0, forced])
            token, replaced = forced, replaced + 1
        batch.accept(req_id, token)
        out.append(token)
        if token == eos:
            break
    assert not batch.take_failures()
    batch.drop(req_id)
    return out, replaced


def _assert_complete(tokenizer: Any, out: list[int], eos: int, max_tokens: int, schema: Any):
    assert len(out) <= max_tokens
    assert out and out[-1] == eos, f"cut without closing: {tokenizer.decode(out)!r}"
    value = json.loads(tokenizer.decode(out[:-1]))
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("schema", [EMAIL, PIZZA, REQUIRED], ids=["email", "pizza", "required"])
@pytest.mark.parametrize("style", ["runaway", "opener"])
def test_forced_output_always_closes_within_max_tokens(
    compiler: GrammarCompiler, tokenizer: Any, texts: list[str], schema: Any, style: str
) -> None:
    eos = compiler.eos_token_id
    assert eos is not None
    so = StructuredOutputsParams(json=schema, within_max_tokens=True)
    need = compiler.min_output_tokens(so)
    assert need is not None and need < 80
    choose = (_runaway if style == "runaway" else _opener)(texts, eos)
    batch = StructuredBatch(compiler)
    closed_before = batch.num_closed
    for seed, max_tokens in enumerate((need, need + 5, 2 * need + 40)):
        params = SamplingParams(max_tokens=max_tokens, structured_outputs=so)
        out, _ = _generate(batch, compiler, params, choose, seed)
        _assert_complete(tokenizer, out, eos, max_tokens, schema)
    # the model never stops on its own: each of those ended because the plan closed it
    assert batch.num_closed - closed_before == 3


def test_without_the_flag_the_runaway_is_cut(compiler: GrammarCompiler, texts: list[str]) -> None:
    """The guard is what closes it: the same walk without within_max_tokens ends cut."""
    eos = compiler.eos_token_id
    assert eos is not None
    params = SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=EMAIL))
    batch = StructuredBatch(compiler)
    out, replaced = _generate(batch, compiler, params, _runaway(texts, eos), 0)
    assert len(out) == 40 and out[-1] != eos and replaced == 0 and not batch.budgets


def test_a_model_that_stops_by_itself_is_left_alone(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """A short call written well inside the budget: no token replaced or forced."""
    eos = compiler.eos_token_id
    target = tokenizer.encode('{"to":"a@b.c","subject":"hi","body":"ok"}', add_special_tokens=False)
    target.append(eos)

    out: list[int] = []

    def choose(mask: torch.Tensor, gen: torch.Generator) -> int:
        token = target[len(out)]
        assert bool(mask[token])
        out.append(token)
        return token

    batch = StructuredBatch(compiler)
    so = StructuredOutputsParams(json=EMAIL, within_max_tokens=True)
    params = SamplingParams(max_tokens=len(target) + 10, structured_outputs=so)
    written, replaced = _generate(batch, compiler, params, choose, 0)
    assert written == target and replaced == 0 and batch.num_closed == 0


def test_replayed_request_keeps_the_budget(compiler: GrammarCompiler, tokenizer: Any) -> None:
    """After a preemption the outputs so far replay: the budget left is what remains."""
    eos = compiler.eos_token_id
    so = StructuredOutputsParams(json=EMAIL, within_max_tokens=True)
    prefix = tokenizer.encode('{"to":"someone at a very long address', add_special_tokens=False)
    batch = StructuredBatch(compiler)
    max_tokens = len(prefix) + 14
    batch.add("r", SamplingParams(max_tokens=max_tokens, structured_outputs=so), prefix)
    budget = batch.budgets["r"]
    assert budget.left == 14 and budget.lex == IN_STRING
    out = list(prefix)
    while out[-1] != eos:
        assert len(out) < max_tokens
        pending = batch.start_masks(["r"])
        assert pending is not None
        mask = pending.result()
        token = int(mask[0].nonzero()[-1])  # the highest allowed id: rarely a closer
        token = batch.vet("r", token) or token
        batch.accept("r", token)
        out.append(token)
    _assert_complete(tokenizer, out, eos, max_tokens, EMAIL)


def test_min_output_tokens_and_the_400(compiler: GrammarCompiler, tokenizer: Any) -> None:
    so = StructuredOutputsParams(
        json={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        within_max_tokens=True,
    )
    need = compiler.min_output_tokens(so)
    plan = closing_plan(compiler.matcher(so), OUT, compiler.closing_tables(), compiler.eos_token_id)
    assert plan is not None and need == len(plan)
    assert json.loads(tokenizer.decode(plan[:-1])) == {"city": ""}
    limits = RequestLimits(max_model_len=2048, vocab_size=49152, max_num_seqs=8)
    ok = SamplingParams(max_tokens=need, structured_outputs=so)
    validate_request([1, 2, 3], ok, limits, grammar=compiler)
    small = SamplingParams(max_tokens=need - 1, structured_outputs=so)
    with pytest.raises(RequestError) as e:
        validate_request([1, 2, 3], small, limits, grammar=compiler)
    assert e.value.param == "max_tokens" and f"max_tokens >= {need}" in str(e.value)
    # without the flag the same max_tokens is accepted (it may end cut)
    plain = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=so.json))
    validate_request([1, 2, 3], plain, limits, grammar=compiler)
    # no max_tokens: the room the prompt leaves counts
    tight = RequestLimits(max_model_len=3 + need - 1, vocab_size=49152, max_num_seqs=8)
    with pytest.raises(RequestError, match="shorten the prompt"):
        validate_request(
            [1, 2, 3],
            SamplingParams(max_tokens=None, structured_outputs=so),
            tight,
            grammar=compiler,
        )


def test_lexical_effect_of_tokens() -> None:
    assert _effect(b'"}', IN_STRING) == (-2, 0, OUT)
    assert _effect(b"abc", IN_STRING) == (0, 3, IN_STRING)
    assert _effect(b'\\"', IN_STRING) == (0, 2, IN_STRING)  # an escaped quote stays inside
    assert _effect(b'{"a', OUT) == (2, 1, IN_STRING)
    assert _effect(b",", OUT) == (0, 0, OUT)
    tables = ClosingTables([b"a", b'"', b"<s>", b"}"], eos_token_id=2, special=set())
    assert int(tables.score[OUT].argmin()) == 2  # EOS first
    assert tables.advance(OUT, 1) == IN_STRING and tables.advance(IN_STRING, 1) == OUT
