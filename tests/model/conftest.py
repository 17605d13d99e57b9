"""Fixtures of the model tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def kernel() -> Any:
    """The native quantized-linear kernel (``default_backend().quant_linear``); skips
    the test where the native kernels are not built."""
    from kvserve.model.kernels.backend import default_backend

    k = default_backend().quant_linear
    if k is None:
        pytest.skip("native kernels unavailable")
    return k
