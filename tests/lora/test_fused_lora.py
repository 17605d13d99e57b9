"""The fused decode step with adapter rows (``kvs_decode_layers`` with a LoRA table)
against the Python layer loop with ``LoRAWeights.apply``: bitwise the same hidden
states and KV writes on the default model in both dtypes, for a mixed batch of base
rows, two adapters (one of them attention-only, so some linears mask its rows) and an
adapter whose B is zero; base and zero-B rows are bitwise a base-only step's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.fused_decode import BS, decode_meta, prefilled
from support.lora_adapters import ATTN, make_adapter

from kvserve.lora.adapter import load_adapter
from kvserve.lora.ops import native_lora_kernel
from kvserve.lora.weights import LoRABatch, LoRAWeights
from kvserve.model.attention import SeqSpec, build_attention_metadata

pytestmark = pytest.mark.usefixtures("single_thread_torch")

# per decode row: its slot (-1 the base; 0 all modules; 1 attention only; 2 zero B)
ROW_SLOTS = [0, -1, 1, 2, 0, 1, -1, 0]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def model_with_lora(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model

    loaded = load_model(DEFAULT_MODEL_NAME, dtype=request.param, quantization="auto")
    model = loaded.model
    if model._fused_decode is None or native_lora_kernel() is None:
        pytest.skip("the native kernels are not built here")
    tmp: Path = tmp_path_factory.mktemp("fused_lora")
    cfg, arch = loaded.hf_config, model.config
    wdtype = torch.bfloat16 if loaded.dtype == torch.bfloat16 else torch.float32
    lw = LoRAWeights(arch, 4, 16, dtype=wdtype)
    lw.native = native_lora_kernel()
    specs = [
        dict(rank=16, seed=1, std=0.1),
        dict(rank=8, seed=2, std=0.1, targets=ATTN),
        dict(rank=8, seed=3, zero_b=True),
    ]
    for slot, kw in enumerate(specs):
        folder = make_adapter(tmp / str(slot), cfg, alpha=16.0, **kw)  # type: ignore[arg-type]
        lw.set_slot(slot, load_adapter(str(folder), arch, 16))
    model.lora_weights = lw
    yield loaded
    model.lora_weights = None


def _step(model, dtype: torch.dtype, lens: list[int]):  # type: ignore[no-untyped-def]
    """KV prefilled for each length, then one decode row per sequence: (kv, caches,
    ids, positions, metadata)."""
    kv, caches, tables = prefilled(model, dtype, lens)
    ids = torch.tensor([101 + 7 * j for j in range(len(lens))])
    return kv, caches, ids, torch.tensor(lens), decode_meta(lens, tables, dtype)


def test_fused_lora_step_is_the_layer_loop(model_with_lora) -> None:  # type: ignore[no-untyped-def]
    model, dtype = model_with_lora.model, model_with_lora.dtype
    fused = model._fused_decode
    lens = [20 + 3 * j for j in range(len(ROW_SLOTS))]
    kv, caches, ids, pos, meta = _step(model, dtype, lens)
    batch = LoRABatch.from_row_slots(ROW_SLOTS)
    assert batch is not None
    assert fused.supports(meta, caches) and fused.supports_lora(model.lora_weights)
    calls: list[int] = []
    real = fused._lora_table

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args)

    fused._lora_table = counted  # type: ignore[method-assign]
    before = kv.clone()
    try:
        with torch.inference_mode():
            out_fused = model(ids, pos, caches, meta, lora=batch)
            kv_fused = kv.clone()
            kv.copy_(before)
            out_again = model(ids, pos, caches, meta, lora=batch)  # the cached table
            kv.copy_(before)
            base = model(ids, pos, caches, meta)  # no adapter rows: the base step
            kv.copy_(before)
            model._fused_decode = None
            try:
                out_loop = model(ids, pos, caches, meta, lora=batch)
            finally:
                model._fused_decode = fused
    finally:
        del fused._lora_table
    assert len(calls) == 2  # both adapter steps ran fused
    assert torch.equal(out_fused, out_loop) and torch.equal(out_again, out_fused)
    assert torch.equal(kv_fused, kv)
    for t, s in enumerate(ROW_SLOTS):
        if s in (-1, 2):  # the base, and the adapter whose B is zero
            assert torch.equal(out_fused[t], base[t]), t
        else:
            assert not torch.equal(out_fused[t], base[t]), t


def test_fused_lora_row_is_the_same_alone(model_with_lora) -> None:  # type: ignore[no-untyped-def]
    """An adapter row's hidden state does not depend on the rest of the batch."""
    model, dtype = model_with_lora.model, model_with_lora.dtype
    lens = [31, 12, 45]
    kv, caches, ids, pos, meta = _step(model, dtype, lens)
    snapshot = kv.clone()
    with torch.inference_mode():
        batched = model(ids, pos, caches, meta, lora=LoRABatch.from_row_slots([1, 0, -1]))
        kv.copy_(snapshot)
        one = build_attention_metadata(
            [SeqSpec(0, 1, 1, lens[1], list(range(5, 9)))], num_tokens=1, block_size=BS,
            kv_segment_size=64, kv_dtype=dtype,
        )  # fmt: skip
        alone = model(ids[1:2], pos[1:2], caches, one, lora=LoRABatch.from_row_slots([0]))
    assert torch.equal(alone[0], batched[1])


def test_portable_lora_keeps_the_loop(model_with_lora) -> None:  # type: ignore[no-untyped-def]
    """Without the native LoRA kernel (``KVSERVE_LORA=portable``) the fused step declines."""
    model = model_with_lora.model
    lw = model.lora_weights
    saved = lw.native
    lw.native = None
    try:
        assert not model._fused_decode.supports_lora(lw)
    finally:
        lw.native = saved
