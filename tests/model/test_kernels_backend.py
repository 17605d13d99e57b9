"""The kernel backend (kvserve/model/kernels/backend.py): one switch per family, read
once, and the named-argument calls of the binding modules."""

from __future__ import annotations

import pytest

from kvserve.model.kernels._ctypes import I64, PTR, CFunction
from kvserve.model.kernels.backend import FAMILY_ENV_VARS, KernelBackend, default_backend
from kvserve.model.kernels.build import load_library


@pytest.fixture(scope="module")
def native() -> KernelBackend:
    backend = KernelBackend.from_env({})
    assert backend.attention is not None, "the test machine has a C++ compiler"
    return backend


def test_every_family_is_native_by_default(native: KernelBackend) -> None:
    assert all(native.families().values()), native.families()
    assert native.prefill_vec is not None and native.prefill_amx is not None
    assert native.library is not None and native.library.exists()


@pytest.mark.parametrize("family", sorted(FAMILY_ENV_VARS))
def test_each_switch_turns_off_its_family_alone(native: KernelBackend, family: str) -> None:
    backend = KernelBackend.from_env({FAMILY_ENV_VARS[family]: "portable"})
    on = backend.families()
    assert on.pop(family) is False
    assert all(on.values()), on
    if family == "attention":  # the prefill kernels belong to attention
        assert backend.prefill_vec is None and backend.prefill_amx is None
    else:
        assert backend.prefill_vec is not None


def test_kernels_portable_turns_off_everything() -> None:
    backend = KernelBackend.from_env({"KVSERVE_KERNELS": "portable", "KVSERVE_LINEAR": "native"})
    assert backend == KernelBackend.portable()
    assert not any(backend.families().values())


def test_a_bad_switch_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="KVSERVE_SAMPLING='off'"):
        KernelBackend.from_env({"KVSERVE_SAMPLING": "off"})


def test_default_backend_follows_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    first = default_backend()
    assert default_backend() is first  # made once per setting
    monkeypatch.setenv("KVSERVE_NORMS", "portable")
    assert default_backend().norms is None and default_backend().attention is not None
    monkeypatch.delenv("KVSERVE_NORMS")
    assert default_backend() is first


def test_named_calls_refuse_missing_and_unknown_arguments(native: KernelBackend) -> None:
    _, lib = load_library()
    fn = CFunction(lib, "kvs_argmax_rows", [("x", PTR), ("rows", I64)], restype=None)
    with pytest.raises(TypeError, match=r"missing \['rows'\], unknown \['cols'\]"):
        fn(x=None, cols=3)
