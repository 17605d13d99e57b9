"""ModelRunner on the default model, driven by hand-built SchedulerOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.request import SamplingParams
from kvserve.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from kvserve.worker.model_runner import ModelRunner, kv_cache_bytes_per_block

pytestmark = pytest.mark.usefixtures("single_thread_torch")

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, logprobs=3)


@dataclass
class Sched:
    """A minimal hand-rolled scheduler view of one request (for building outputs)."""

    req_id: str
    tokens: list[int]
    blocks: list[int]
    computed: int = 0
    seen: bool = False
    outputs: list[int] = field(default_factory=list)


def step(
    items: list[tuple[Sched, int, int]],
    *,
    finished: set[str] | None = None,
    decode_batch_size_padded: int | None = None,
) -> SchedulerOutput:
    """One SchedulerOutput scheduling ``(req, num_tokens, padded)`` for each item."""
    new, cached = [], CachedRequestData()
    for r, _, _ in items:
        if not r.seen:
            new.append(NewRequestData(r.req_id, r.tokens, [], r.blocks, r.computed, GREEDY))
        else:
            cached.req_ids.append(r.req_id)
            cached.new_block_ids.append([])
            cached.num_computed_tokens.append(r.computed)
    so = SchedulerOutput(
        phase="mixed",
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={r.req_id: n for r, n, _ in items},
        num_scheduled_tokens_padded={r.req_id: p for r, _, p in items},
        scheduled_token_ids={r.req_id: r.tokens[r.computed : r.computed + n] for r, n, _ in items},
        cached_seq_len={r.req_id: r.computed for r, _, _ in items},
        finished_req_ids=finished or set(),
        decode_batch_size_padded=decode_batch_size_padded,
    )
    for r, n, _ in items:
        r.seen = True
        r.computed += n
    return so


def apply(so: SchedulerOutput, out, reqs: list[Sched]) -> None:
    """Append sampled tokens to the requests that completed (as the scheduler would)."""
    for r in reqs:
        toks = out.sampled_token_ids.get(r.req_id, [])
        r.tokens.extend(toks)
        r.outputs.extend(toks)


@pytest.fixture
def runner(loaded_model) -> ModelRunner:
    return ModelRunner(
        # segments of 32 tokens (below what a config allows) so short prompts cross them
        loaded_model,
        CacheConfig(block_size=BLOCK, num_kv_blocks=64, kv_segment_size=32),
        SchedulerConfig(),
    )


@pytest.fixture
def captured_logits(runner: ModelRunner):
    """Every logits tensor the runner computes, in order."""
    seen: list[torch.Tensor] = []
    original = runner.model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        seen.append(logits.clone())
        return logits

    runner.model.compute_logits = capture  # instance attribute shadows the method
    yield seen
    del runner.model.compute_logits


def prompt(loaded_model, n: int) -> list[int]:
    text = "Paged attention stores keys and values in fixed-size blocks. " * 20
    return loaded_model.tokenizer(text)["input_ids"][:n]


def changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Slots (block * BLOCK + offset) whose K or V changed in any layer or head."""
    diff = (before != after).any(-1)  # [layers, 2, Hk, blocks, block_size]
    diff = diff.flatten(0, 2).any(0).flatten()  # [blocks * block_size]
    return set(torch.nonzero(diff).flatten().tolist())


def slots(blocks: list[int], start: int, end: int) -> set[int]:
    return {blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)}


def test_padding_is_invisible(runner: ModelRunner, captured_logits, loaded_model) -> None:
    ids = prompt(loaded_model, 100)
    a = Sched("a", list(ids), list(range(1, 8)))
    b = Sched("b", list(ids), list(range(10, 17)))
    out_a = runner.execute_model(so := step([(a, 100, 100)]))
    apply(so, out_a, [a])

    before = runner.kv_cache.clone()
    out_b = runner.execute_model(so := step([(b, 100, 128)]))  # 28 padding rows
    apply(so, out_b, [b])
    assert changed_slots(before, runner.kv_cache) == slots(b.blocks, 0, 100)
    assert out_a.sampled_token_ids["a"] == out_b.sampled_token_ids["b"]
    torch.testing.assert_close(captured_logits[1], captured_logits[0], atol=1e-4, rtol=0)
    kv = runner.kv_cache
    torch.testing.assert_close(kv[:, :, :, 10:17], kv[:, :, :, 1:8], atol=1e-4, rtol=0)

    # decode both: as a batch of 2, then padded to 8 rows with dummy rows
    before = runner.kv_cache.clone()
    out = runner.execute_model(so := step([(a, 1, 1), (b, 1, 1)], decode_batch_size_padded=8))
    apply(so, out, [a, b])
    assert changed_slots(before, runner.kv_cache) == slots(a.blocks, 100, 101) | slots(
        b.blocks, 100, 101
    )
    assert torch.equal(runner.kv_cache[:, :, :, 0], before[:, :, :, 0]), "null block written"
    assert out.sampled_token_ids["a"] == out.sampled_token_ids["b"]
    padded_logits = captured_logits[-1]
    assert padded_logits.shape[0] == 2  # dummy rows get no logits
    out = runner.execute_model(so := step([(a, 1, 1), (b, 1, 1)]))
    apply(so, out, [a, b])
    torch.testing.assert_close(padded_logits[0], padded_logits[1], atol=1e-4, rtol=0)
    lp = out.logprobs["a"][0]
    assert len(lp.top_token_ids) == 3 and lp.sampled_logprob <= 0.0


def test_chunked_prefill_samples_only_at_the_end(runner: ModelRunner, loaded_model) -> None:
    ids = prompt(loaded_model, 40)
    whole = Sched("whole", list(ids), [1, 2, 3])
    out = runner.execute_model(step([(whole, 40, 40)]))
    expected = out.sampled_token_ids["whole"]
    assert len(expected) == 1

    chunked = Sched("chunked", list(ids), [5, 6, 7])
    got = []
    for n in (16, 17, 7):  # the second chunk ends mid-block
        got.append(runner.execute_model(step([(chunked, n, n)])).sampled_token_ids["chunked"])
    assert got == [[], [], expected]


def test_mixed_step_matches_separate_steps(runner: ModelRunner, loaded_model) -> None:
    """A decode row listed before a prefill chunk in one step: same results as alone."""
    ids = prompt(loaded_model, 70)

    def run(mixed: bool, tag: str, first_block: int) -> dict[str, tuple[list[int], list[float]]]:
        d = Sched("d" + tag, list(ids[:30]), [first_block, first_block + 1])
        p = Sched("p" + tag, list(ids[30:66]), [first_block + 2, first_block + 3, first_block + 4])
        out = runner.execute_model(so := step([(d, 30, 30), (p, 16, 16)]))
        apply(so, out, [d, p])
        if mixed:
            outs = [runner.execute_model(step([(d, 1, 1), (p, 20, 20)]))]
        else:
            outs = [
                runner.execute_model(step([(d, 1, 1)])),
                runner.execute_model(step([(p, 20, 20)])),
            ]
        res = {}
        for o in outs:
            for req_id, toks in o.sampled_token_ids.items():
                lp = o.logprobs[req_id][0]
                res[req_id[0]] = (toks, lp.top_logprobs)
        return res

    mixed = run(True, "m", 1)
    alone = run(False, "s", 20)
    assert mixed.keys() == alone.keys() == {"d", "p"}
    for k in ("d", "p"):
        assert mixed[k][0] == alone[k][0]
        assert mixed[k][1] == pytest.approx(alone[k][1], abs=1e-4)


def test_finished_requests_are_dropped_and_unknown_ones_rejected(
    runner: ModelRunner, loaded_model
) -> None:
    a = Sched("a", prompt(loaded_model, 20), [1, 2])
    runner.execute_model(step([(a, 20, 20)]))
    assert "a" in runner.input_batch.requests
    out = runner.execute_model(step([], finished={"a"}))
    assert out.sampled_token_ids == {}
    assert "a" not in runner.input_batch.requests
    with pytest.raises(RuntimeError, match="does not know"):
        runner.execute_model(step([(a, 1, 1)]))
    bad = Sched("bad", prompt(loaded_model, 20), [1, 64])  # the runner has 64 blocks
    with pytest.raises(RuntimeError, match=r"outside \[1, 64\)"):
        runner.execute_model(step([(bad, 20, 20)]))


def test_preempted_request_resumes_identically(runner: ModelRunner, loaded_model) -> None:
    ids = prompt(loaded_model, 50)
    a = Sched("a", list(ids), [1, 2, 3, 4])
    out = runner.execute_model(so := step([(a, 50, 50)]))
    apply(so, out, [a])
    for _ in range(4):
        out = runner.execute_model(so := step([(a, 1, 1)]))
        apply(so, out, [a])
    # preempted after 3 outputs: recompute prompt + outputs from scratch in other blocks
    b = Sched("a", list(ids) + a.outputs[:3], [9, 10, 11, 12], outputs=a.outputs[:3])
    so = step([(b, 53, 53)], finished={"a"})
    so.scheduled_new_reqs[0].prompt_token_ids = list(ids)
    so.scheduled_new_reqs[0].output_token_ids = a.outputs[:3]
    out = runner.execute_model(so)
    assert out.sampled_token_ids["a"] == [a.outputs[3]]
    assert runner.input_batch.requests["a"].sampling.output_token_ids == a.outputs[:4]


def test_kv_cache_sizing(loaded_model) -> None:
    per_block = kv_cache_bytes_per_block(loaded_model, BLOCK)
    cfg = loaded_model.model.config
    assert per_block == 2 * cfg.num_layers * BLOCK * cfg.num_kv_heads * cfg.head_dim * 4
    r = ModelRunner(
        loaded_model, CacheConfig(block_size=BLOCK, kv_cache_memory_gib=0.01), SchedulerConfig()
    )
    assert r.num_kv_blocks == int(0.01 * (1 << 30)) // per_block
    assert r.kv_cache.shape == (
        cfg.num_layers,
        2,
        cfg.num_kv_heads,
        r.num_kv_blocks,
        BLOCK,
        cfg.head_dim,
    )
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        ModelRunner(
            loaded_model,
            CacheConfig(block_size=BLOCK, kv_cache_memory_gib=1e-6),
            SchedulerConfig(),
        )
