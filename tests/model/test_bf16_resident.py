"""bfloat16 weights with native panels are resident once: after ``prepare`` the
parameters (and a tied embedding) are empty placeholders, the layers run on the panels
alone, a tied embedding's rows come bitwise from the lm_head's panels, and preparing
again (with or without the fast kernels) restores the dense weights bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.tiny_models import random_llama

from kvserve.model.kernels.backend import default_backend
from kvserve.model.linear import FastLinear
from kvserve.model.llama import LlamaForCausalLM

NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _tiny_bf16(tied: bool) -> LlamaForCausalLM:
    return random_llama(96, 64, 128, tied=tied).to(torch.bfloat16)


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_panels_are_the_only_resident_copy(tied: bool) -> None:
    lk = default_backend().linear
    if lk is None or not lk.linear_bf16_available:
        pytest.skip("no AVX512-BF16 panels in this build")
    model = _tiny_bf16(tied)
    dense = {(i, n): getattr(layer, n).detach().clone() for i, layer in enumerate(model.layers)
             for n in NAMES}  # fmt: skip
    embed = model.embed_tokens.detach().clone()
    head = model.lm_head_weight.detach().clone()
    model.prepare()
    for i, layer in enumerate(model.layers):
        for n in NAMES:
            assert getattr(layer, n).numel() == 0, f"layer {i} {n} still holds a dense copy"
    assert model.lm_head_weight.numel() == 0
    assert (model.embed_tokens.numel() == 0) == tied  # an untied embedding stays dense
    ops = model._ops[0]
    assert isinstance(ops.qkv, FastLinear) and ops.qkv.weight is None and ops.qkv.packed is None
    x = torch.randn(40, 64).bfloat16()
    torch.testing.assert_close(
        ops.qkv(x).float(), F.linear(x.float(), dense[(0, "qkv_proj")].float()), atol=0.1, rtol=2e-2
    )
    ids = torch.tensor([[0, 95, 33], [31, 32, 7]])
    assert torch.equal(model.embed(ids), F.embedding(ids, embed))
    total = sum(t.numel() * 2 for t in dense.values()) + head.numel() * 2
    total += 0 if tied else embed.numel() * 2
    assert model.weight_bytes() <= total * 1.05, "a weight is resident twice"
    # preparing again starts from the weights: bitwise the dense values back
    model.prepare(fast=False)
    for (i, n), w in dense.items():
        assert torch.equal(getattr(model.layers[i], n), w)
    assert torch.equal(model.lm_head_weight, head) and torch.equal(model.embed_tokens, embed)
    model.prepare()
    assert torch.equal(model.embed(ids), F.embedding(ids, embed))
