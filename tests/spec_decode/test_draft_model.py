"""The draft-model proposer on a tiny random Llama: its incremental proposals (own
paged KV cache, catch-up over the common prefix, its rejected drafts recomputed)
equal the greedy continuation computed from scratch, round after round, with blocks
returned on drop. The end-to-end engine run (the default model as its own draft) is
in ``test_spec_exact.py``."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
from support.tiny_models import random_llama

from kvserve.kv_cache.manager import cdiv
from kvserve.spec_decode.draft_model import CATCH_UP_CHUNK, DraftModelProposer


def tiny_loaded() -> SimpleNamespace:
    model = random_llama(50, 32, 64)
    model.prepare()
    return SimpleNamespace(model=model, device=torch.device("cpu"), dtype=torch.float32)


def greedy_from_scratch(loaded, history: list[int], k: int) -> list[int]:
    fresh = DraftModelProposer(loaded, num_blocks=80, block_size=4, max_model_len=256)
    assert fresh.propose(["x"], [history], [k]) == [[]]  # first sight: prefill deferred
    for _ in range(cdiv(len(history), CATCH_UP_CHUNK) + 1):  # catch-up chunks, then drafts
        got = fresh.propose(["x"], [history], [k])[0]
        if got:
            return got
    raise AssertionError("no proposal after the catch-up chunks")


def test_incremental_proposals_equal_greedy_from_scratch_across_rejections():
    loaded = tiny_loaded()
    p = DraftModelProposer(loaded, num_blocks=64, block_size=4, max_model_len=128)
    rng = random.Random(1)
    histories = {"a": [3, 7, 9, 11, 2], "b": [5, 5, 1]}
    free_before = len(p._free)
    # first sight of a request: nothing computed (its first token is not delayed)
    assert p.propose(list(histories), list(histories.values()), [3, 3]) == [[], []]
    assert len(p._free) == free_before
    for _ in range(6):
        ids = list(histories)
        ks = [rng.randint(1, 4) for _ in ids]
        got = p.propose(ids, [histories[r] for r in ids], ks)
        for r, k, drafts in zip(ids, ks, got, strict=True):
            assert drafts == greedy_from_scratch(loaded, histories[r], k)
            m = rng.randint(0, len(drafts))  # accepted drafts, then a different token
            histories[r] = (
                histories[r] + drafts[:m] + [(drafts[m] + 1) % 50 if m < len(drafts) else 4]
            )
    p.drop("a")
    p.drop("b")
    assert len(p._free) == free_before
    # no blocks free: no proposal (and nothing breaks)
    tight = DraftModelProposer(loaded, num_blocks=2, block_size=4, max_model_len=128)
    assert tight.propose(["c"], [list(range(1, 12))], [3]) == [[]]
    assert tight.propose(["c"], [list(range(1, 12))], [3]) == [[]]


def test_long_prompt_catches_up_in_chunks_without_delaying_the_first_token():
    loaded = tiny_loaded()
    p = DraftModelProposer(loaded, num_blocks=64, block_size=4, max_model_len=256)
    history = [(7 * i) % 50 for i in range(CATCH_UP_CHUNK * 2 + 5)]
    calls: list[int] = []
    forward = p._forward
    p._forward = lambda chunks: calls.append(sum(len(c[1]) for c in chunks)) or forward(chunks)
    assert p.propose(["r"], [history], [3]) == [[]]
    assert calls == []  # the first token's step does no draft work
    assert p.propose(["r"], [history], [3]) == [[]]
    assert p.propose(["r"], [history], [3]) == [[]]
    assert calls == [CATCH_UP_CHUNK, CATCH_UP_CHUNK]  # one bounded chunk per call
    drafts = p.propose(["r"], [history], [3])[0]
    assert len(drafts) == 3 and calls[2] == 5  # the rest, then the proposal
    assert drafts == greedy_from_scratch(loaded, history, 3)


def test_sampled_requests_get_sampled_drafts_with_their_distributions():
    from kvserve.request import SamplingParams
    from kvserve.sampling.sampler import SamplingRequestState

    loaded = tiny_loaded()
    p = DraftModelProposer(loaded, num_blocks=64, block_size=4, max_model_len=128)
    history = [3, 7, 9, 11, 2]
    hot = SamplingRequestState(SamplingParams(temperature=1.0, seed=3, max_tokens=50), [3], [])
    hot.output_token_ids = history[1:]
    greedy = SamplingRequestState(SamplingParams(temperature=0.0, max_tokens=50), [3], [])
    ids, hists, ks = ["s", "g"], [history, history], [3, 3]
    p.propose(ids, hists, ks, [hot, greedy])  # first sight: deferred
    s_drafts, g_drafts = p.propose(ids, hists, ks, [hot, greedy])
    assert g_drafts == greedy_from_scratch(loaded, history, 3)
    assert p.draft_probs("g", g_drafts) is None  # greedy drafts are fixed tokens
    assert p.draft_probs("s", [(s_drafts[0] + 1) % 50]) is None  # not its proposal
    s_drafts, _ = p.propose(ids, hists, ks, [hot, greedy])
    q = p.draft_probs("s", s_drafts[:2])  # a prefix (the budget may cut drafts)
    assert q is not None and q.shape == (2, 50)
    assert torch.allclose(q.sum(-1), torch.ones(2))
    assert all(float(q[j, s_drafts[j]]) > 0 for j in range(2))
    assert p.draft_probs("s", s_drafts[:2]) is None  # one verification per proposal
    # seeded: the same history and seed propose the same sampled drafts
    again = DraftModelProposer(loaded, num_blocks=64, block_size=4, max_model_len=128)
    again.propose(["s"], [history], [3], [hot])
    assert again.propose(["s"], [history], [3], [hot])[0] == s_drafts
    p.drop("s")
    assert "s" not in p._q


def stand_in_target(loaded, histories: dict[str, list[int]]) -> DraftModelProposer:
    """A stand-in for the target's cache: a proposer whose KV holds every history's
    rows (computed by the model itself, one request id per history)."""
    t = DraftModelProposer(loaded, num_blocks=80, block_size=4, max_model_len=256)
    ids, hists = list(histories), list(histories.values())
    t.propose(ids, hists, [1] * len(ids))
    for _ in range(max(cdiv(len(h), CATCH_UP_CHUNK) for h in hists) + 1):
        if all(t.propose(ids, hists, [1] * len(ids))):
            return t
    raise AssertionError("the stand-in target never caught up")


def test_target_kv_copy_replaces_the_catch_up_and_proposes_the_same_drafts():
    loaded = tiny_loaded()
    p = DraftModelProposer(loaded, num_blocks=64, block_size=4, max_model_len=128)
    rng = random.Random(2)
    histories = {"a": [(5 * i) % 50 for i in range(23)], "b": [5, 5, 1]}
    free_before = len(p._free)
    calls: list[int] = []
    forward = p._forward
    p._forward = lambda chunks: calls.append(sum(len(c[1]) for c in chunks)) or forward(chunks)
    for _ in range(5):
        # the target's KV of this round: every position before each history's last token
        t = stand_in_target(loaded, histories)
        assert p.attach_target(t.kv_cache, lambda r, t=t: t._reqs[r].block_ids)
        ids = list(histories)
        ks = [rng.randint(1, 4) for _ in ids]
        calls.clear()
        got = p.propose(ids, [histories[r] for r in ids], ks)  # no deferral, no prefill
        assert calls[0] == len(ids)  # the first forward: each request's last token alone
        for r, k, drafts in zip(ids, ks, got, strict=True):
            assert drafts == greedy_from_scratch(loaded, histories[r], k)
            m = rng.randint(0, len(drafts))  # accepted drafts, then a different token
            histories[r] = (
                histories[r] + drafts[:m] + [(drafts[m] + 1) % 50 if m < len(drafts) else 4]
            )
    assert p.kv_rows_copied > 0 and p.last_catch_up_time == 0.0
    p.drop("a")
    p.drop("b")
    assert len(p._free) == free_before


def test_target_kv_is_used_only_for_the_same_checkpoint_and_layout():
    from kvserve.spec_decode.target_kv import same_norm_weights

    loaded = tiny_loaded()
    other = tiny_loaded()
    with torch.no_grad():
        for layer in other.model.layers:
            layer.input_layernorm.mul_(-1.0)  # another checkpoint of the same shape
    assert same_norm_weights(loaded.model, loaded.model)
    assert not same_norm_weights(other.model, loaded.model)
    p = DraftModelProposer(loaded, num_blocks=16, block_size=4, max_model_len=64)
    target_cache = torch.zeros_like(p.kv_cache)
    p.same_weights = False
    assert not p.attach_target(target_cache, lambda r: None) and not p.uses_target_kv
    p.same_weights = True
    p.share_target_kv = False  # the config turned it off
    assert not p.attach_target(target_cache, lambda r: None)
    p.share_target_kv = True
    assert not p.attach_target(target_cache.to(torch.bfloat16), lambda r: None)  # dtype
    assert not p.attach_target(target_cache[..., :4].contiguous(), lambda r: None)  # shape
    assert p.attach_target(target_cache, lambda r: None) and p.uses_target_kv
    # a request whose target block table is unknown gets no proposal, and no blocks
    free = len(p._free)
    assert p.propose(["z"], [[1, 2, 3]], [2]) == [[]] and len(p._free) == free
