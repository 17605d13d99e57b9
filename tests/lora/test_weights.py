"""The batched low-rank delta against a row-by-row reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.lora_adapters import ATTN, MLP, make_adapter, tiny_hf_config

from kvserve.lora.adapter import load_adapter, module_shapes
from kvserve.lora.ops import native_lora_kernel
from kvserve.lora.weights import FUSED_PARTS, LoRABatch, LoRAWeights, lora_delta_torch
from kvserve.model.arch import ModelArchConfig

HF = tiny_hf_config()
ARCH = ModelArchConfig.from_hf_config(HF)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoRAWeights, list]:
    tmp = tmp_path_factory.mktemp("lora")
    w = LoRAWeights(ARCH, 3, 8)
    adapters = [
        load_adapter(str(make_adapter(tmp / "a", HF, rank=8, seed=1, std=0.3)), ARCH, 8),
        load_adapter(
            str(make_adapter(tmp / "b", HF, rank=4, seed=2, std=0.3, targets=ATTN)), ARCH, 8
        ),
        load_adapter(
            str(make_adapter(tmp / "c", HF, rank=2, seed=3, std=0.3, targets=MLP)), ARCH, 8
        ),
    ]
    for slot, a in enumerate(adapters):
        w.set_slot(slot, a)
    return w, adapters


def reference(x: torch.Tensor, f: str, layer: int, slots: list[int], adapters) -> torch.Tensor:
    """Row by row: each part's scale * B @ (A @ x), from the adapter's own tensors."""
    shapes = module_shapes(ARCH)
    outs = []
    for t, s in enumerate(slots):
        parts = []
        for m in FUSED_PARTS[f]:
            a = adapters[s] if s >= 0 else None
            pair = a.weights.get((layer, m)) if a is not None else None
            out_f = shapes[m][0]
            if pair is None:
                parts.append(torch.zeros(out_f, dtype=torch.float64))
            else:
                A, B = pair
                parts.append(a.scale * (B.double() @ (A.double() @ x[t].double())))
        outs.append(torch.cat(parts))
    return torch.stack(outs)


@pytest.mark.parametrize("f", list(FUSED_PARTS))
@pytest.mark.parametrize("use_native", [False, True])
def test_mixed_rows_match_the_reference(weights, f: str, use_native: bool) -> None:
    w, adapters = weights
    if use_native and native_lora_kernel() is None:
        pytest.skip("no native LoRA kernel here")
    saved = w.native
    w.native = native_lora_kernel() if use_native else None
    try:
        slots = [0, -1, 2, 1, 1, 0, -1, 2, 0]
        in_f = w.in_features[f]
        x = torch.randn(len(slots), in_f, generator=torch.Generator().manual_seed(7))
        base = torch.randn(len(slots), w.offsets[f][-1])
        y = base.clone()
        w.apply(1, f, x, y, LoRABatch.from_row_slots(slots))
        want = base.double() + reference(x, f, 1, slots, adapters)
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(y[1], base[1]) and torch.equal(y[6], base[6])  # base rows untouched
    finally:
        w.native = saved


def test_groups_slices_and_gathers() -> None:
    b = LoRABatch.from_row_slots([1, 1, -1, 0, 1])
    assert b is not None
    kinds = {s: r for s, r in b.groups}
    assert kinds[0] == slice(3, 4)
    assert isinstance(kinds[1], torch.Tensor) and kinds[1].tolist() == [0, 1, 4]
    assert LoRABatch.from_row_slots([-1, -1]) is None


def test_zero_b_leaves_rows_bitwise(tmp_path: Path) -> None:
    w = LoRAWeights(ARCH, 1, 8)
    w.set_slot(0, load_adapter(str(make_adapter(tmp_path / "z", HF, rank=8, zero_b=True)), ARCH, 8))
    for native in (None, native_lora_kernel()):
        w.native = native
        x = torch.randn(5, 32)
        y = torch.randn(5, w.offsets["qkv"][-1])
        y0 = y.clone()
        w.apply(0, "qkv", x, y, LoRABatch.from_row_slots([0] * 5))
        assert torch.equal(y, y0)


def test_bfloat16_rows(weights) -> None:
    w, adapters = weights
    slots = [0, 1, -1]
    x = torch.randn(3, 32).to(torch.bfloat16)
    y = torch.zeros(3, w.offsets["qkv"][-1], dtype=torch.bfloat16)
    lora_delta_torch(
        x,
        y,
        w.A[0]["qkv"],
        w.Bt[0]["qkv"],
        LoRABatch.from_row_slots(slots),
        w.offsets["qkv"],
        w.rank,
    )
    want = reference(x.float(), "qkv", 0, slots, adapters)
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)


def test_native_kernel_is_built_here() -> None:
    """This project's CPUs build the kernels; the torch path is only the fallback."""
    import os

    if (
        os.environ.get("KVSERVE_LORA") == "portable"
        or os.environ.get("KVSERVE_KERNELS") == "portable"
    ):
        pytest.skip("the portable path was asked for")
    assert native_lora_kernel() is not None


def _portable_kernel(tmp_path: Path):  # type: ignore[no-untyped-def]
    """lora.cpp compiled without AVX-512 (its portable loops), bound as NativeLoRA."""
    import ctypes
    import shutil
    import subprocess

    from kvserve.lora.ops import NativeLoRA
    from kvserve.model.kernels._ctypes import I32, I64, PTR, CFunction
    from kvserve.model.kernels.build import CSRC

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    so = tmp_path / "liblora_portable.so"
    cmd = [cxx, "-O2", "-march=x86-64", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC",
           "-std=c++17", str(CSRC / "lora.cpp"), "-o", str(so)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    names = ["x", "x_stride", "y", "y_stride", "rows", "in_f", "out_f", "A", "Bt", "row_slot",
             "offsets", "parts", "rank", "dtype", "w_dtype", "nthreads"]  # fmt: skip
    types = [PTR, I64, PTR, I64, I64, I64, I64, PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32]
    return NativeLoRA(
        CFunction(ctypes.CDLL(str(so)), "kvs_lora_delta", list(zip(names, types, strict=True)))
    )


def test_portable_cpp_path_matches(weights, tmp_path: Path) -> None:
    """lora.cpp compiled without AVX-512 (its portable loops) gives the same deltas."""
    portable = _portable_kernel(tmp_path)
    w, adapters = weights
    saved = w.native
    try:
        slots = [2, 0, -1, 1]
        for f in FUSED_PARTS:
            x = torch.randn(len(slots), w.in_features[f])
            y = torch.randn(len(slots), w.offsets[f][-1])
            outs = []
            for kernel in (portable, None):
                w.native = kernel
                yy = y.clone()
                w.apply(0, f, x, yy, LoRABatch.from_row_slots(slots))
                outs.append(yy)
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    finally:
        w.native = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_row_is_bitwise_the_same_alone_and_in_a_batch(weights, dtype) -> None:
    """Tiles of rows of one slot share loads, never the order of a row's sums."""
    w, _ = weights
    if native_lora_kernel() is None:
        pytest.skip("no native LoRA kernel here")
    saved = w.native
    w.native = native_lora_kernel()
    try:
        slots = [0, 0, 1, 0, 0, 0, 2, 0, -1, 0]
        for f in FUSED_PARTS:
            x = torch.randn(len(slots), w.in_features[f]).to(dtype)
            y = torch.randn(len(slots), w.offsets[f][-1]).to(dtype)
            batch = y.clone()
            w.apply(0, f, x, batch, LoRABatch.from_row_slots(slots))
            for t, s in enumerate(slots):
                if s < 0:
                    assert torch.equal(batch[t], y[t])
                    continue
                alone = y[t : t + 1].clone()
                one = LoRABatch.from_row_slots([s])
                assert one is not None
                w.apply(0, f, x[t : t + 1], alone, one)
                assert torch.equal(alone[0], batch[t]), (f, t)
    finally:
        w.native = saved


def _odd_case(wdtype: torch.dtype, xdtype: torch.dtype, seed: int = 0, rank: int = 3):  # type: ignore[no-untyped-def]
    """Shapes off every block size: in 37 (not a multiple of 16 or 32), rank 3 (P*R = 9:
    two blocks of 4 A rows and one; an even rank takes the bf16 pair expand), parts of
    70, 5 and 21 columns (64-column blocks, 16-column blocks and scalar tails); 11 rows
    over 3 slots and the base."""
    g = torch.Generator().manual_seed(seed)
    slots, in_f, offs = 3, 37, [0, 70, 75, 96]
    a = (torch.randn(slots, 3 * rank, in_f, generator=g) * 0.3).to(wdtype)
    bt = (torch.randn(slots, rank, offs[-1], generator=g) * 0.3).to(wdtype)
    row_slots = [2, 0, 0, -1, 1, 0, 0, 0, 0, 2, 0]
    x = torch.randn(len(row_slots), in_f, generator=g).to(xdtype)
    y = torch.randn(len(row_slots), offs[-1], generator=g).to(xdtype)
    return a, bt, row_slots, x, y, offs, rank


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_odd_shapes_native_and_portable_match_torch(
    tmp_path: Path, wdtype: torch.dtype, xdtype: torch.dtype, rank: int
) -> None:
    """Every block and tail of the tiled kernel (AVX-512 build, and the portable one)
    against the torch reference, in every rows x weights dtype and an odd and an even
    rank (bf16 x bf16 with an even rank: the pair expand); base rows untouched."""
    native = native_lora_kernel()
    if native is None:
        pytest.skip("no native LoRA kernel here")
    a, bt, row_slots, x, y, offs, rank = _odd_case(wdtype, xdtype, rank=rank)
    batch = LoRABatch.from_row_slots(row_slots)
    assert batch is not None
    want = y.clone()
    lora_delta_torch(x, want, a, bt, batch, offs, rank)
    tol = 1e-5 if xdtype == torch.float32 else 2e-2
    for kernel in (native, _portable_kernel(tmp_path)):
        got = y.clone()
        kernel.delta(x, got, a, bt, batch.row_slots, torch.tensor(offs), rank)
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)
        assert torch.equal(got[3], y[3])


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_tiled_rows_are_bitwise_alone_and_in_a_batch(
    wdtype: torch.dtype, threads: int, rank: int
) -> None:
    """A row's delta is the same bitwise alone, in tiles of 2-4 rows and over threads."""
    native = native_lora_kernel()
    if native is None:
        pytest.skip("no native LoRA kernel here")
    a, bt, row_slots, x, y, offs, rank = _odd_case(wdtype, torch.bfloat16, seed=1, rank=rank)
    offsets = torch.tensor(offs)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # many rows, so the kernel's work estimate asks for every thread
        big = torch.cat([x] * 40)
        ys = torch.cat([y] * 40)
        slots = torch.tensor(row_slots * 40, dtype=torch.int32)
        native.delta(big, ys, a, bt, slots, offsets, rank)
        for t, s in enumerate(row_slots):
            alone = y[t : t + 1].clone()
            native.delta(x[t : t + 1], alone, a, bt, torch.tensor([s], dtype=torch.int32),
                         offsets, rank)  # fmt: skip
            for rep in range(40):
                assert torch.equal(ys[rep * len(row_slots) + t], alone[0]), (t, rep)
    finally:
        torch.set_num_threads(saved)


def test_bfloat16_slot_tensors_match_the_reference(tmp_path: Path) -> None:
    """bfloat16 slot tensors (a bfloat16 model's): the rounded adapter's delta."""
    w = LoRAWeights(ARCH, 2, 8, dtype=torch.bfloat16)
    a = load_adapter(str(make_adapter(tmp_path / "a", HF, rank=8, seed=4, std=0.3)), ARCH, 8)
    w.set_slot(1, a)
    assert (
        w.A[0]["qkv"].dtype == torch.bfloat16 and w.nbytes() * 2 == LoRAWeights(ARCH, 2, 8).nbytes()
    )
    for native in (native_lora_kernel(), None):
        w.native = native
        for f in FUSED_PARTS:
            x = torch.randn(3, w.in_features[f]).to(torch.bfloat16)
            y = torch.zeros(3, w.offsets[f][-1], dtype=torch.bfloat16)
            batch = LoRABatch.from_row_slots([1, -1, 1])
            assert batch is not None
            w.apply(0, f, x, y, batch)
            want = reference(x.float(), f, 0, [1, -1, 1], [None, a])
            torch.testing.assert_close(y.double(), want, rtol=3e-2, atol=3e-2)
            assert not y[1].any()


def test_slot_tensor_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        LoRAWeights(ARCH, 1, 4, dtype=torch.float16)
