"""Model loading: named default, cached GGUF conversion, HF folders, clear errors."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from support.tiny_models import save_tiny_hf_llama

from kvserve.model import loader
from kvserve.model.loader import (
    DEFAULT_MODEL_NAME,
    load_model,
    load_tokenizer,
    resolve_model,
)


def test_default_model_folder_is_complete(default_model_dir: Path) -> None:
    names = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "kvserve_meta.json"} <= names
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert default_model_dir.parent.parent == loader.cache_dir()


def test_second_resolve_does_not_convert_again(default_model_dir: Path, monkeypatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(loader, "convert_gguf", fail)
    t0 = time.perf_counter()
    assert resolve_model(DEFAULT_MODEL_NAME) == default_model_dir
    assert time.perf_counter() - t0 < 5  # generous; a conversion takes ~15 s


def test_tokenizer_has_chat_template(default_model_dir: Path) -> None:
    tok = load_tokenizer(DEFAULT_MODEL_NAME)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "hi" in text and text.rstrip().endswith("assistant")
    assert tok.decode(tok("Hello world")["input_ids"]) == "Hello world"


def test_loaded_model_fields(loaded_model) -> None:
    assert loaded_model.name == DEFAULT_MODEL_NAME
    assert loaded_model.max_model_len == 8192
    assert loaded_model.tokenizer.eos_token_id in loaded_model.eos_token_ids
    assert len(loaded_model.fingerprint) == 64
    assert loaded_model.model.config.num_layers == 30
    assert not loaded_model.model.training


def test_fingerprint_is_stable_and_depends_on_dtype(loaded_model) -> None:
    again = load_model(DEFAULT_MODEL_NAME, dtype="float32", quantization="none")
    assert again.fingerprint == loaded_model.fingerprint
    bf16 = load_model(DEFAULT_MODEL_NAME, dtype="bfloat16", quantization="none")
    assert bf16.fingerprint != loaded_model.fingerprint
    assert bf16.model.embed_tokens.dtype == torch.bfloat16


# ------------------------------------------------------------------ conversion cache


def test_concurrent_conversions_run_once_and_publish_atomically(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake")
    calls = []

    def fake_convert(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")
        time.sleep(0.3)  # other threads arrive while this one converts
        (out / "model.safetensors").write_bytes(b"x")
        (out / "kvserve_meta.json").write_text("{}")

    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model(str(gguf)))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(set(results)) == 1 and len(results) == 4
    folder = results[0]
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "kvserve_meta.json",
        "model.safetensors",
    ]
    leftovers = [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_file_digest_memo_is_safe_across_threads(tmp_path, monkeypatch) -> None:
    """Threads of one process share a pid: each writer needs its own temporary file, or
    one truncates the memo another already renamed into place and a reader sees ''."""
    import hashlib

    from kvserve.model import model_files

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "w.bin"
    f.write_bytes(b"weights" * 1000)
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    memo_dir = tmp_path / "cache" / "fingerprints"
    for _ in range(20):
        if memo_dir.exists():
            for p in memo_dir.iterdir():
                p.unlink()
        got: list[str] = []

        def digest(out: list[str] = got) -> None:
            out.append(model_files._file_digest_memo(f))

        threads = [threading.Thread(target=digest) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == [want] * 8
    assert [p.name for p in memo_dir.iterdir() if p.suffix != ".txt"] == []
    # a truncated memo (an interrupted writer) is recomputed, not trusted
    (memo,) = memo_dir.iterdir()
    memo.write_text("")
    assert model_files._file_digest_memo(f) == want
    assert memo.read_text() == want


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake")

    def broken(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise ValueError("cannot convert")

    monkeypatch.setattr(loader, "convert_gguf", broken)
    with pytest.raises(ValueError, match="cannot convert"):
        resolve_model(str(gguf))
    models = tmp_path / "cache" / "models"
    assert [p for p in models.iterdir() if p.is_dir()] == []


# ------------------------------------------------------------------ errors


def test_unknown_name_names_what_is_supported() -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model-anywhere")


def test_folder_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"lacks \*\.safetensors"):
        resolve_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(f))


def test_unreadable_gguf(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read GGUF"):
        resolve_model(str(f))


def test_gguf_of_unsupported_architecture(tmp_path: Path, monkeypatch) -> None:
    from gguf import GGUFWriter

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(f), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'.*llama"):
        resolve_model(str(f))


def test_unsupported_architecture_in_folder(tmp_path: Path, default_model_dir: Path) -> None:
    save_tiny_hf_llama(tmp_path, default_model_dir)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="supported are LlamaForCausalLM"):
        load_model(str(tmp_path))


def test_checkpoint_missing_a_tensor(tmp_path: Path, default_model_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny_hf_llama(tmp_path, default_model_dir)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.0.mlp.up_proj.weight'"):
        load_model(str(tmp_path))


def test_bad_dtype(default_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        load_model(DEFAULT_MODEL_NAME, dtype="int8")


def test_auto_dtype_follows_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """dtype="auto": bfloat16 exactly where the CPU has avx512_bf16 or AMX, else float32."""
    from kvserve.model import dtypes as loader

    assert loader.cpu_has_native_bf16("flags\t\t: fpu avx512f avx512_bf16 sse\n")
    assert loader.cpu_has_native_bf16("flags\t\t: fpu amx_bf16 amx_tile\n")
    assert not loader.cpu_has_native_bf16("flags\t\t: fpu avx512f avx2\n")
    assert not loader.cpu_has_native_bf16("")
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda cpuinfo=None: True)
    assert loader.parse_dtype("auto") == torch.bfloat16
    assert loader.parse_dtype("auto", "meta") == torch.float32  # not a CPU
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda cpuinfo=None: False)
    assert loader.parse_dtype("auto") == torch.float32


def _gguf_copies(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Two files of the same bytes (another clone, another name) and one of others."""
    a = tmp_path / "clone1" / "m.gguf"
    b = tmp_path / "clone2" / "renamed.gguf"
    c = tmp_path / "other.gguf"
    for p, data in ((a, b"GGUF same"), (b, b"GGUF same"), (c, b"GGUF different")):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return a, b, c


def test_conversion_cache_is_keyed_by_content(tmp_path, monkeypatch, capsys) -> None:
    """Two copies of one GGUF (other clone, other name) share one converted folder;
    different bytes convert again; the one-time conversion says what it is doing."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    a, b, c = _gguf_copies(tmp_path)
    calls: list[Path] = []

    def fake_convert(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")
        (out / "kvserve_meta.json").write_text("{}")

    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    first = resolve_model(str(a))
    assert "converting m.gguf once" in capsys.readouterr().err
    assert resolve_model(str(b)) == first
    assert len(calls) == 1
    assert resolve_model(str(c)) != first
    assert len(calls) == 2


def test_metadata_folder_is_keyed_by_content(tmp_path, monkeypatch) -> None:
    """The quantized run's metadata-only folder: copies of one GGUF (another clone,
    another name, a newer mtime) share one folder; different bytes get their own."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    a, b, c = _gguf_copies(tmp_path)
    os.utime(b, ns=(1, 1))
    calls: list[Path] = []

    def fake_write(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "kvserve_meta.json").write_text("{}")

    monkeypatch.setattr(loader, "write_gguf_metadata", fake_write)
    first = loader.resolve_gguf_metadata(a, "m")
    assert loader.resolve_gguf_metadata(b, "renamed") == first
    assert loader.resolve_gguf_metadata(a, "m") == first
    assert calls == [a]
    assert loader.resolve_gguf_metadata(c, "other") != first
    assert calls == [a, c]


def test_a_conversion_parses_each_gguf_once(tmp_path, monkeypatch) -> None:
    """Inside ``_gguf_parsed_once`` every ``gguf.GGUFReader(path)`` of one unchanged file
    is one parse, a changed file is parsed again, tensor-name maps are built once per
    (arch, layers), and both ``gguf`` attributes are restored afterwards."""
    import os

    import gguf

    from kvserve.model.model_files import _gguf_parsed_once

    parses: list[str] = []
    maps: list[tuple[object, int]] = []

    class CountingReader:
        def __init__(self, path, mode="r"):
            parses.append(str(path))

    def counting_map(arch, n_blocks):
        maps.append((arch, n_blocks))
        return object()

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_map)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with _gguf_parsed_once():
        first = gguf.GGUFReader(f)
        assert gguf.GGUFReader(str(f)) is first and len(parses) == 1
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert gguf.GGUFReader(f) is not first and len(parses) == 2  # changed: parsed again
        gguf.GGUFReader(f, "r+")  # a writable reader is never shared
        assert len(parses) == 3
        m = gguf.get_tensor_name_map("llama", 30)
        assert gguf.get_tensor_name_map("llama", 30) is m
        gguf.get_tensor_name_map("llama", 2)
        assert maps == [("llama", 30), ("llama", 2)]
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is counting_map
