"""``kvserve.model.hugepages``: the KV pool's zeroed huge-page allocation."""

from __future__ import annotations

import torch

from kvserve.model import hugepages


def test_zeros_hugepages_is_a_zeroed_contiguous_tensor() -> None:
    for shape, dtype in (((3, 5 << 20), torch.bfloat16), ((7,), torch.float32)):
        t = hugepages.zeros_hugepages(*shape, dtype=dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()


def test_advice_covers_only_whole_huge_pages(monkeypatch) -> None:
    calls: list[tuple[int, int, int]] = []

    def fake(addr: int, length: int, advice: int) -> int:
        calls.append((addr, length, advice))
        return 0

    monkeypatch.setattr(hugepages, "_madvise", lambda: fake)
    big = torch.empty(6 << 20, dtype=torch.uint8)
    assert hugepages.advise_hugepages(big)
    ((addr, length, advice),) = calls
    start, end = big.data_ptr(), big.data_ptr() + big.numel()
    assert advice == hugepages.MADV_HUGEPAGE
    assert addr % hugepages.HUGE_PAGE == 0 and length % hugepages.HUGE_PAGE == 0
    assert start <= addr and addr + length <= end and length >= 4 << 20
    calls.clear()
    assert not hugepages.advise_hugepages(torch.empty(1 << 20, dtype=torch.uint8))
    assert not calls  # smaller than a huge page: nothing to advise
    monkeypatch.setenv(hugepages.ENV_VAR, "0")
    assert not hugepages.advise_hugepages(big) and not calls


def test_kv_pool_is_allocated_zeroed_on_the_cpu() -> None:
    from types import SimpleNamespace

    from kvserve.worker.model_runner import allocate_kv_cache

    model = SimpleNamespace(config=SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=8))
    cache = allocate_kv_cache(model, 5, 4, torch.bfloat16)  # type: ignore[arg-type]
    assert cache.shape == (2, 2, 3, 5, 4, 8) and cache.dtype == torch.bfloat16
    assert not cache.any()
