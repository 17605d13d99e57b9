"""Batch invariance on the default model: a position's logits bitwise the same however
it was scheduled (alone, beside other requests, in a prefill chunk of any size, as a
decode row, after a prefix-cache hit), in bfloat16 and float32. See
docs/determinism.md and tests/support/invariance.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.invariance import Harness, Seq, first_mismatch

from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.model.kernels.backend import default_backend

pytestmark = pytest.mark.usefixtures("single_thread_torch")

_KERNEL = default_backend().linear
needs_f32 = pytest.mark.skipif(
    _KERNEL is None or not _KERNEL.linear_f32_available, reason="needs the AVX-512 panels"
)
needs_bf16 = pytest.mark.skipif(
    _KERNEL is None or not _KERNEL.linear_bf16_available, reason="needs AVX512-BF16 panels"
)


@pytest.fixture(scope="module")
def bf16_model():
    from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model

    return load_model(DEFAULT_MODEL_NAME, dtype="bfloat16")


@pytest.fixture(params=["float32", "bfloat16"])
def model_of(request, loaded_model):
    if request.param == "float32":
        if _KERNEL is None or not _KERNEL.linear_f32_available:
            pytest.skip("needs the AVX-512 panels")
        return loaded_model
    if _KERNEL is None or not _KERNEL.linear_bf16_available:
        pytest.skip("needs AVX512-BF16 panels")
    return request.getfixturevalue("bf16_model")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _chunks(rng: random.Random, total: int, max_chunk: int) -> list[int]:
    """A random split of ``total`` tokens into chunks, ones (decode rows) included."""
    out = []
    while total:
        n = 1 if rng.random() < 0.3 else rng.randint(1, min(total, max_chunk))
        n = min(n, total)
        out.append(n)
        total -= n
    return out


def _random_schedule(h: Harness, target: Seq, others: list[Seq], rng: random.Random) -> None:
    """Run ``target`` to its end beside ``others`` in random chunks (others stop early)."""
    plans = {id(s): _chunks(rng, len(s.tokens) - s.computed, 70) for s in [target, *others]}
    while plans[id(target)]:
        step = [(s, plans[id(s)].pop(0)) for s in [target, *others] if plans[id(s)]]
        h.step(step, num_dummy=rng.choice([0, 0, 1, 3]))


@given(seed=st.integers(0, 2**31 - 1))
@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_logits_bitwise_whatever_the_schedule(model_of, seed: int) -> None:
    """Hypothesis over batch compositions, chunk sizes and cache states: every logits
    row of the target equals, bit for bit, the same position run alone in one chunk."""
    rng = random.Random(seed)
    loaded = model_of
    h = Harness(loaded.model, loaded.dtype, num_blocks=96, kv_segment_size=32, batch_invariant=True)
    target_tokens = _tokens(rng, rng.randint(16, 120))
    ref = h.run_alone(target_tokens)
    others = [h.new_seq(_tokens(rng, rng.randint(2, 60))) for _ in range(rng.randint(0, 5))]
    target = h.new_seq(target_tokens)
    if rng.random() < 0.5 and len(target_tokens) >= 32:
        # a prefix-cache hit: the first blocks were written by another request
        shared = rng.randrange(16, len(target_tokens) - 8, 16)
        donor = h.new_seq(target_tokens[:shared] + _tokens(rng, 5))
        h.step([(donor, len(donor.tokens))])
        target = h.new_seq(target_tokens, prefix_from=donor, shared=shared)
        if rng.random() < 0.5:  # and a sibling on the same prefix, for cascade grouping
            others.append(h.new_seq(target_tokens[:shared] + _tokens(rng, 9), donor, shared))
    _random_schedule(h, target, others, rng)
    assert first_mismatch(target, ref) is None, (
        f"mismatch at position {first_mismatch(target, ref)}"
    )
    for s in others:  # every other request is someone's target too
        if s.logits and s.computed == len(s.tokens):
            alone = Harness(
                loaded.model, loaded.dtype, num_blocks=16, kv_segment_size=32, batch_invariant=True
            ).run_alone(s.tokens)
            assert first_mismatch(s, alone) is None


@given(seed=st.integers(0, 2**31 - 1))
@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_automatic_mode_short_requests_bitwise(model_of, seed: int) -> None:
    """The default (automatic) mode: a request within ``invariant_max_context`` gets
    bitwise the logits it gets alone, beside requests past that reach (which take the
    fast prefill kernels and cascade groups) and prefix-cache siblings."""
    rng = random.Random(seed)
    loaded = model_of
    reach = 160
    segment = rng.choice([0, 32, 64])  # one size for every run: it sets the key parts

    def harness(blocks: int) -> Harness:
        return Harness(
            loaded.model,
            loaded.dtype,
            num_blocks=blocks,
            kv_segment_size=segment,
            batch_invariant=False,
            invariant_max_context=reach,
        )

    h = harness(160)
    target_tokens = _tokens(rng, rng.randint(16, reach - 10))
    ref = harness(16).run_alone(target_tokens)
    shared = 80
    system = _tokens(rng, shared)
    donor = h.new_seq(system + _tokens(rng, 100))  # past the reach
    h.step([(donor, len(donor.tokens))])
    others = [h.new_seq(system + _tokens(rng, rng.randint(90, 150)), donor, shared)]
    others += [h.new_seq(_tokens(rng, rng.randint(reach, 240))) for _ in range(2)]
    others += [h.new_seq(_tokens(rng, rng.randint(2, 60))) for _ in range(rng.randint(0, 3))]
    if len(target_tokens) > shared + 8 and rng.random() < 0.6:
        target_tokens = system + target_tokens[shared:]
        ref = harness(16).run_alone(target_tokens)
        target = h.new_seq(target_tokens, prefix_from=donor, shared=shared)
    else:
        target = h.new_seq(target_tokens)
    _random_schedule(h, target, others, rng)
    assert first_mismatch(target, ref) is None, (
        f"mismatch at position {first_mismatch(target, ref)}"
    )


@pytest.mark.parametrize("segment", [0, 512])
def test_long_prompt_chunked_and_decoded(model_of, segment: int) -> None:
    """A 600-token prompt in chunks crossing a 512-token segment, then decode rows in a
    batch of 32 rows, against the prompt alone in one chunk."""
    rng = random.Random(7)
    loaded = model_of
    toks = _tokens(rng, 600)
    h = Harness(
        loaded.model, loaded.dtype, num_blocks=160, kv_segment_size=segment, batch_invariant=True
    )
    ref = h.run_alone(toks)
    s = h.new_seq(toks)
    others = [h.new_seq(_tokens(rng, 50)) for _ in range(31)]
    h.step([(s, 500), *[(o, 30) for o in others[:4]]])
    h.step([(s, 90)] + [(o, 1 if o.computed else 20) for o in others])
    for _ in range(10):
        h.step([(s, 1)] + [(o, 1) for o in others])
    assert first_mismatch(s, ref) is None


def test_invariant_metadata_runs_requests_whole() -> None:
    """The invariant metadata: every request whole (prior and new keys) in the paged
    kernel, no prior-only split, no cascade, no flash/vector-prefill part."""
    if _KERNEL is None:
        pytest.skip("needs the native kernel")
    specs = [
        SeqSpec(0, 4, 3, 16, [1, 2]),  # a prefill chunk with one padding row
        SeqSpec(4, 1, 1, 40, [3, 4, 5]),  # a decode row
        SeqSpec(5, 1, 1, 40, [3, 4, 6]),  # a decode row sharing 2 blocks (cascade off)
    ]
    meta = build_attention_metadata(
        specs,
        num_tokens=8,
        num_dummy_decode_rows=2,
        block_size=16,
        kv_segment_size=512,
        kv_dtype=torch.bfloat16,
        batch_invariant=True,
    )
    nb = meta.native
    assert nb is not None and nb.prefills == [] and nb.cascade is None
    assert nb.prefill_seqs is None and nb.decode_seqs is None
    np.testing.assert_array_equal(
        nb.seqs.numpy(),
        [
            [0, 4, 3, 16, 0],  # whole: rows attend to [0, 16 + j]
            [4, 1, 1, 40, 0],
            [5, 1, 1, 40, 0],
            [6, 1, 1, 0, 0],  # dummy rows: the null block
            [7, 1, 1, 0, 0],
        ],
    )
    np.testing.assert_array_equal(
        nb.block_tables.numpy(), [[1, 2, 0], [3, 4, 5], [3, 4, 6], [0, 0, 0], [0, 0, 0]]
    )


def test_automatic_metadata_splits_at_the_reach() -> None:
    """The automatic mode: a chunk crossing the reach is split there, its head (and
    every request within the reach) runs whole with the decode rows in the paged
    kernel, and only rows past the reach form cascade groups."""
    if _KERNEL is None:
        pytest.skip("needs the native kernel")
    shared = list(range(1, 9))  # 8 shared blocks: 128 tokens
    specs = [
        SeqSpec(0, 40, 40, 80, list(range(20, 28))),  # crosses 100: head 20 rows, tail 20
        SeqSpec(40, 1, 1, 90, [*shared[:5], 30, 31]),  # decode within the reach
        SeqSpec(41, 1, 1, 90, [*shared[:5], 32, 33]),  # its sibling: no cascade group
        SeqSpec(42, 1, 1, 200, [*shared, 34, 35, 36, 37, 38]),  # past the reach
        SeqSpec(43, 1, 1, 200, [*shared, 40, 41, 42, 43, 44]),  # cascade with the one above
    ]
    meta = build_attention_metadata(
        specs,
        num_tokens=44,
        block_size=16,
        kv_segment_size=64,
        kv_dtype=torch.bfloat16,
        invariant_max_context=100,
    )
    nb = meta.native
    assert nb is not None
    c = nb.cascade
    if nb.decode_seqs is None:  # no AMX/vector prefill kernel: one call, head whole
        np.testing.assert_array_equal(
            nb.seqs[:2].numpy(), [[0, 20, 20, 80, 0], [20, 20, 20, 100, 0]]
        )
        return
    assert c is not None
    np.testing.assert_array_equal(
        c.decode_seqs[:3].numpy(), [[0, 20, 20, 80, 0], [40, 1, 1, 90, 0], [41, 1, 1, 90, 0]]
    )
    assert nb.prefill_seqs is not None
    np.testing.assert_array_equal(nb.prefill_seqs.numpy(), [[20, 20, 20, 100, 0]])
    np.testing.assert_array_equal(c.row_map.numpy(), [42, 43])  # only the long ones
    np.testing.assert_array_equal(c.group_seqs.numpy(), [[0, 2, 2, 128, 1]])


@needs_f32
def test_linear_rows_invariant_at_every_m(loaded_model) -> None:
    """In invariant mode a linear's row is bitwise the same at every row count."""
    lin = loaded_model.model._ops[0].gate_up
    before = lin.invariant
    lin.invariant = True
    try:
        x = torch.randn(70, lin.weight.shape[1], generator=torch.Generator().manual_seed(0))
        full = lin(x)
        for m in (1, 3, 5, 8, 9, 31, 33, 64):
            assert torch.equal(lin(x[:m]), full[:m]), m
            assert torch.equal(lin(x[70 - m :]), full[70 - m :]), m
    finally:
        lin.invariant = before


def test_resolve_batch_invariant_rules(loaded_model) -> None:
    from kvserve.worker.invariance_mode import resolve_batch_invariant

    model = loaded_model.model
    with pytest.raises(ValueError, match="compile"):
        resolve_batch_invariant(True, model, "native", True)
    with pytest.raises(ValueError, match="must be True, False or None"):
        resolve_batch_invariant("yes", model, "native", False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="native kernels"):
        resolve_batch_invariant(True, model, "portable", False)
    assert resolve_batch_invariant(False, model, "native", False) is False
    from kvserve.model.attention_metadata import AUTO_INVARIANT_MAX_CONTEXT
    from kvserve.worker.invariance_mode import resolve_auto_invariance

    assert resolve_auto_invariance(True, model, "native", False) == 0
    assert resolve_auto_invariance(False, model, "native", False) == 0
    assert resolve_auto_invariance(None, model, "native", True) == 0  # compile
    assert resolve_auto_invariance(None, model, "portable", False) == 0
    want = AUTO_INVARIANT_MAX_CONTEXT if model.auto_invariance_cheap else 0
    assert resolve_auto_invariance(None, model, "native", False) == want
    assert resolve_batch_invariant(None, model, "native", True) is False  # compile wins
    auto = resolve_batch_invariant(None, model, "native", False)
    assert auto == (model.batch_invariant_supported and model.batch_invariant_default)
