"""The fused decode step (``kvs_decode_layers``, kvserve/model/llama_native.py) against
the Python layer loop it replaces: the same hidden states and the same KV writes,
bitwise, on the default Q4_1 model in both dtypes and on its float weights (packed
panels), at 1 and several rows and with a speculative verification's chunk; prefill
steps, 8-bit caches, float linears without panels and rows past the panels keep the
loop; the switch turns it off."""

from __future__ import annotations

import pytest
import torch
from support.fused_decode import BS, assert_fused_is_loop, decode_meta, prefilled

from kvserve.model.attention import SeqSpec, build_attention_metadata
from kvserve.model.llama_native import FusedDecode
from kvserve.worker.model_runner import allocate_kv_cache

pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def quant(request):  # type: ignore[no-untyped-def]
    from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model

    loaded = load_model(DEFAULT_MODEL_NAME, dtype=request.param, quantization="auto")
    if loaded.model._fused_decode is None:
        pytest.skip("the native kernels are not built here")
    return loaded


@pytest.mark.parametrize("lens", [[23], [17, 40, 9]])
def test_fused_step_is_the_python_loop(quant, lens: list[int]) -> None:  # type: ignore[no-untyped-def]
    _decode_is_loop(quant, lens)


def _decode_is_loop(loaded, lens: list[int]) -> None:  # type: ignore[no-untyped-def]
    """One decode row per length, prefilled first: the fused step is the loop."""
    model, dtype = loaded.model, loaded.dtype
    kv, caches, tables = prefilled(model, dtype, lens)
    ids = torch.tensor([101 + 7 * j for j in range(len(lens))])
    assert_fused_is_loop(
        model, kv, caches, ids, torch.tensor(lens), decode_meta(lens, tables, dtype)
    )


def test_fused_row_independent_of_batch(quant) -> None:  # type: ignore[no-untyped-def]
    model, dtype = quant.model, quant.dtype
    lens = [20, 31, 12, 45]
    kv, caches, tables = prefilled(model, dtype, lens)
    ids = torch.tensor([300, 301, 302, 303])
    snapshot = kv.clone()
    with torch.inference_mode():
        batched = model(ids, torch.tensor(lens), caches, decode_meta(lens, tables, dtype))
        kv.copy_(snapshot)
        alone = model(
            ids[2:3], torch.tensor(lens[2:3]), caches, decode_meta(lens[2:3], tables[2:3], dtype)
        )
    assert torch.equal(alone[0], batched[2])


def test_prefill_and_8bit_cache_keep_the_loop(quant) -> None:  # type: ignore[no-untyped-def]
    model, dtype = quant.model, quant.dtype
    fused = model._fused_decode
    assert fused is not None
    _, caches, tables = prefilled(model, dtype, [20])
    prefill = build_attention_metadata(
        [SeqSpec(0, 4, 4, 20, tables[0])], num_tokens=4, block_size=BS, kv_segment_size=64,
        kv_dtype=dtype,
    )  # fmt: skip
    assert not fused.supports(prefill, caches)
    decode = decode_meta([20], tables, dtype)
    assert fused.supports(decode, caches)
    assert not fused.supports(decode, caches[:-1])  # one cache per layer
    int8 = [torch.zeros(c.shape[:-1] + (c.shape[-1] + 4,), dtype=torch.int8) for c in caches]
    assert not fused.supports(decode, int8)


def test_verification_chunk_is_the_python_loop(quant) -> None:  # type: ignore[no-untyped-def]
    """A speculative verification's rows (a short chunk over cached KV within the
    invariance reach, beside a decode row) take the fused step, bitwise the loop."""
    model, dtype = quant.model, quant.dtype
    fused = model._fused_decode
    lens = [20, 33]
    kv, caches, tables = prefilled(model, dtype, lens)
    specs = [SeqSpec(0, 5, 5, lens[0], tables[0]), SeqSpec(5, 1, 1, lens[1], tables[1])]

    def meta(reach: int):  # type: ignore[no-untyped-def]
        return build_attention_metadata(
            specs, num_tokens=6, block_size=BS, kv_segment_size=64, kv_dtype=dtype,
            invariant_max_context=reach,
        )  # fmt: skip

    assert not fused.supports(meta(0), caches)  # outside the reach: the prefill kernels
    m = meta(4096)
    assert fused.supports(m, caches)
    ids = torch.tensor([101, 102, 103, 104, 105, 300])
    pos = torch.tensor([20, 21, 22, 23, 24, 33])
    assert_fused_is_loop(model, kv, caches, ids, pos, m, loop_meta=meta(4096))


def test_switch_turns_it_off(quant, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    model = quant.model
    monkeypatch.setenv("KVSERVE_FUSED_DECODE", "0")
    assert FusedDecode.build(model, model.kernels) is None
    monkeypatch.setenv("KVSERVE_FUSED_DECODE", "yes")
    with pytest.raises(ValueError, match="KVSERVE_FUSED_DECODE"):
        FusedDecode.build(model, model.kernels)
    monkeypatch.setenv("KVSERVE_FUSED_DECODE", "1")
    assert FusedDecode.build(model, model.kernels) is not None


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dense(request, loaded_model):  # type: ignore[no-untyped-def]
    """The default model with float weights (``quantization="none"``): packed panels."""
    from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model

    if request.param == "float32":
        loaded = loaded_model  # the session's fp32 float model
    else:
        loaded = load_model(DEFAULT_MODEL_NAME, dtype="bfloat16", quantization="none")
    if loaded.model._fused_decode is None:
        pytest.skip("no native panels for this dtype here")
    return loaded


@pytest.mark.parametrize("lens", [[23], [17, 40, 9]])
def test_dense_step_is_the_python_loop(dense, lens: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Float weights run their packed panels (kvs_linear_f32/bf16, then kvs_silu_mul
    for gate_up) inside the fused step: bitwise the loop, same KV writes."""
    _decode_is_loop(dense, lens)


def test_dense_rows_past_the_panels_keep_the_loop(dense) -> None:  # type: ignore[no-untyped-def]
    """Past the rows at which FastLinear runs the panels (bfloat16: 4, float32: 32) the
    loop's linears take oneDNN or AMX tiles: no fused step, unless batch-invariant mode
    routes every linear through the panels; then bitwise the loop again."""
    from kvserve.model.linear import NATIVE_BF16_MAX_M, NATIVE_F32_MAX_M

    model, dtype = dense.model, dense.dtype
    fused = model._fused_decode
    limit = NATIVE_F32_MAX_M if dtype == torch.float32 else NATIVE_BF16_MAX_M
    lens = [20 + j for j in range(limit + 1)]
    kv = allocate_kv_cache(model, 1 + 4 * len(lens), BS, dtype)
    caches = list(kv.unbind(0))
    tables = [list(range(1 + 4 * s, 5 + 4 * s)) for s in range(len(lens))]
    was = model.batch_invariant  # a shared model: other tests' harnesses set the mode
    model.set_batch_invariant(False)
    try:
        assert fused.supports(decode_meta(lens[:limit], tables[:limit], dtype), caches)
        assert not fused.supports(decode_meta(lens, tables, dtype), caches)
        if not model.batch_invariant_supported:
            return
        model.set_batch_invariant(True)
        assert fused.supports(decode_meta(lens, tables, dtype), caches)
        if dtype == torch.bfloat16:  # 5 rows: compare with the loop
            kv, caches, tables = prefilled(model, dtype, lens)
            ids, pos = torch.arange(300, 300 + len(lens)), torch.tensor(lens)
            assert_fused_is_loop(model, kv, caches, ids, pos, decode_meta(lens, tables, dtype))
    finally:
        model.set_batch_invariant(was)


def test_linears_without_panels_keep_the_loop(loaded_model) -> None:  # type: ignore[no-untyped-def]
    """A float linear the fused step cannot call as the loop does (no packed panels:
    torch's kernels) leaves the whole model on the loop."""
    model = loaded_model.model
    assert FusedDecode.build(model, model.kernels) is not None
    lin = model._ops[3].o
    panels = lin.panels
    lin.panels = None
    try:
        assert FusedDecode.build(model, model.kernels) is None
    finally:
        lin.panels = panels


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_qk_norms_in_the_fused_step(dtype: str, tmp_path, default_model_dir) -> None:  # type: ignore[no-untyped-def]
    """A Qwen3-shaped model (per-head q/k RMSNorm before RoPE) runs the native layers and
    the fused step: its decode rows are bitwise the Python loop's (the norm is
    ``kvs_head_rms_norm`` in both), and the norm is applied (not the step without it)."""
    from test_model_vs_hf import make_tiny_model  # type: ignore[import-not-found]

    from kvserve.model.loader import load_model

    folder = tmp_path / "qwen3"
    folder.mkdir()
    make_tiny_model("qwen3", folder, default_model_dir)
    loaded = load_model(str(folder), dtype=dtype)
    model = loaded.model
    if model._fused_decode is None:
        pytest.skip("no native panels for this dtype here")
    assert model.uses_native_layers and model._ops[0].qk_norm is not None
    lens = [23, 40, 9]
    kv, caches, tables = prefilled(model, loaded.dtype, lens, vocab=(100, 320))
    ids, pos = torch.tensor([5, 17, 33]), torch.tensor(lens)
    meta = decode_meta(lens, tables, loaded.dtype)
    assert_fused_is_loop(model, kv, caches, ids, pos, meta)
    snapshot = kv.clone()
    with torch.inference_mode():  # a row's result does not depend on the batch
        batched = model(ids, pos, caches, decode_meta(lens, tables, loaded.dtype))
        kv.copy_(snapshot)
        alone = model(ids[1:2], pos[1:2], caches, decode_meta(lens[1:2], tables[1:2], loaded.dtype))
        kv.copy_(snapshot)
    assert torch.equal(alone[0], batched[1])
    norms = [ops.qk_norm for ops in model._ops]
    with torch.inference_mode():
        ref = model(ids, pos, caches, decode_meta(lens, tables, loaded.dtype))
        for ops in model._ops:  # all-ones norm weights: a different result
            ops.qk_norm = torch.ones_like(ops.qk_norm)
        model._fused_decode = FusedDecode.build(model, model.kernels)
        try:
            other = model(ids, pos, caches, decode_meta(lens, tables, loaded.dtype))
        finally:
            for ops, w in zip(model._ops, norms, strict=True):
                ops.qk_norm = w
    assert not torch.equal(ref, other)
