"""Model files on disk: the cache root, GGUF reading and conversion, weight digests.

:func:`convert_gguf` dequantizes a GGUF file through transformers into an HF folder
(fp32 safetensors, config, tokenizer, ``kvserve_meta.json``);
:func:`write_gguf_metadata` writes the same folder without weights (a quantized run
reads the tensors from the GGUF file itself). The caching around both (content keys,
locks, atomic renames) is :mod:`kvserve.model.loader`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

_CONVERTED_FORMAT_VERSION = 2
_META_FORMAT_VERSION = 1  # config + tokenizer only folders of quantized GGUF runs
_META_FILE = "kvserve_meta.json"


def cache_dir() -> Path:
    """Root of kvserve's caches: ``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve``."""
    env = os.environ.get("KVSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"


def _file_digest_memo(path: Path) -> str:
    """sha256 of one file's bytes, memoized under ``cache_dir()/fingerprints``."""
    st = path.stat()
    ident = f"file|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo = cache_dir() / "fingerprints" / (hashlib.sha256(ident.encode()).hexdigest()[:24] + ".txt")
    with contextlib.suppress(OSError):
        memoized = memo.read_text().strip()
        if len(memoized) == 64:  # a complete digest; anything else is recomputed
            return memoized
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    _memoize(memo, digest)
    return digest


def _memoize(memo: Path, digest: str) -> None:
    """Write ``digest`` to ``memo`` atomically; an unwritable cache is not an error."""
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        # a private temporary per writer (threads share a pid): a shared name let one
        # thread truncate the file another had already renamed into place
        fd, tmp_name = tempfile.mkstemp(prefix=memo.name + ".", suffix=".tmp", dir=memo.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(digest)
            os.replace(tmp_name, memo)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)


def _progress(msg: str) -> None:
    """One line of conversion progress on stderr (the conversion runs once per file)."""
    print(f"kvserve: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While open, transformers parses each GGUF file once and builds gguf's tensor-name
    map once per (architecture, layer count).

    transformers reads a GGUF with ``gguf.GGUFReader`` for the tokenizer, the config
    and the weights (2.5-4 s each on the default model: its tokenizer's 49k-entry
    arrays become one NumPy view per element), and builds a ``TensorNameMap`` for
    every module it walks (about 400 x 14 ms). Both results are read-only to it, so
    one of each is shared. The patch covers the ``gguf`` module's attributes (which
    transformers imports inside its functions) and is undone on exit; callers keep
    conversions of one process serial (the conversion cache's file lock does).
    """
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, int, int], Any] = {}
    maps: dict[tuple[Any, int], Any] = {}

    def reader(path: Any, mode: Any = "r") -> Any:
        if mode != "r":
            return real_reader(path, mode)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    def name_map(arch: Any, n_blocks: int) -> Any:
        if (arch, n_blocks) not in maps:
            maps[(arch, n_blocks)] = real_map(arch, n_blocks)
        return maps[(arch, n_blocks)]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map  # type: ignore[misc]


def write_gguf_metadata(gguf_path: Path, out_dir: Path) -> None:
    arch = supported_gguf_architecture(gguf_path)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    folder, name = gguf_path.parent, gguf_path.name
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
            hf_config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, NotImplementedError, KeyError, OSError) as e:
        raise ValueError(f"cannot read GGUF file {str(gguf_path)!r}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    config = hf_config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["dtype"] = "float32"
    archs = config.get("architectures") or [_MODEL_TYPE_ARCHITECTURES.get(config["model_type"], "")]
    config["architectures"] = archs
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    GenerationConfig.from_model_config(hf_config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    meta = {
        "format_version": _META_FORMAT_VERSION,
        "source": str(gguf_path),
        "source_architecture": arch,
        "weights_sha256": _weights_digest([gguf_path]),
        "weights": "gguf",
    }
    (out_dir / _META_FILE).write_text(json.dumps(meta, indent=2))


def gguf_architecture(gguf_path: Path) -> str:
    """``general.architecture`` of a GGUF file; ValueError when it cannot be read."""
    try:
        from kvserve.model.quant.gguf_file import read_gguf

        return read_gguf(gguf_path).string("general.architecture")
    except Exception as e:  # noqa: BLE001 - any parse failure is "unreadable"
        raise ValueError(
            f"cannot read GGUF file {str(gguf_path)!r}: {e}. Pass a valid GGUF file of "
            f"architecture {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        ) from e


def supported_gguf_architecture(gguf_path: Path) -> str:
    """:func:`gguf_architecture`, with a ValueError naming the supported ones when it
    is not one of them."""
    arch = gguf_architecture(gguf_path)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(gguf_path)!r} has architecture {arch!r}; supported GGUF "
            f"architectures are {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return arch


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file through transformers and write an HF folder to ``out_dir``.

    Writes config.json (no quantization section), model.safetensors (fp32; a tied
    ``lm_head.weight`` is left out as HF does), tokenizer files with the chat
    template, generation_config.json and ``kvserve_meta.json`` (source and weights
    digest). Raises ValueError for unsupported architectures or tensor types.
    """
    arch = supported_gguf_architecture(gguf_path)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, name = gguf_path.parent, gguf_path.name
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with _gguf_parsed_once():
            _progress("  reading the tokenizer and chat template")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
            _progress("  dequantizing the weights to float32 (the longest part)")
            hf_model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, local_files_only=True, dtype=torch.float32
            )
    except (ValueError, NotImplementedError, KeyError, OSError) as e:
        raise ValueError(
            f"cannot convert GGUF file {str(gguf_path)!r}: {e}. Supported: GGUF files of "
            f"architecture {', '.join(SUPPORTED_GGUF_ARCHITECTURES)} with tensor types "
            f"that the gguf package can dequantize (F32, F16, BF16, Q4_0/Q4_1/Q5/Q8, K-quants)"
        ) from e
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress:
            hf_logging.enable_progress_bar()

    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["dtype"] = "float32"
    config["architectures"] = [type(hf_model).__name__]
    tied = bool(config.get("tie_word_embeddings", False))
    state = {
        k: v.detach().to(torch.float32).contiguous()
        for k, v in hf_model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    weights = out_dir / "model.safetensors"
    _progress(f"  writing {len(state)} tensors to {weights.name}")
    save_file(state, str(weights), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if hf_model.generation_config is not None:
        hf_model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    meta = {
        "format_version": _CONVERTED_FORMAT_VERSION,
        "source": str(gguf_path),
        "source_architecture": arch,
        "weights_sha256": _weights_digest([weights]),
    }
    (out_dir / _META_FILE).write_text(json.dumps(meta, indent=2))


# --------------------------------------------------------------------------- digests


def _weights_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def weights_digest(folder: Path) -> str:
    """sha256 over the folder's safetensors files, memoized by (path, size, mtime)."""
    meta = folder / _META_FILE
    if meta.is_file():
        with contextlib.suppress(ValueError, KeyError):
            return str(json.loads(meta.read_text())["weights_sha256"])
    files = sorted(folder.glob("*.safetensors"))
    ident = "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    memo = cache_dir() / "fingerprints" / (hashlib.sha256(ident.encode()).hexdigest()[:24] + ".txt")
    if memo.is_file():
        return memo.read_text().strip()
    digest = _weights_digest(files)
    _memoize(memo, digest)
    return digest


def _fingerprint(weights: str, dtype: str, rope: dict[str, Any], arch: str) -> str:
    """Stable digest of everything that changes KV contents (the prefix-cache key)."""
    try:
        from kvserve.kv_cache.hashing import model_fingerprint
    except ImportError:  # the KV cache package is optional for loading a model
        payload = json.dumps([weights, dtype, rope, arch], sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()
    return model_fingerprint(f"weights:{weights}", dtype, rope, arch)
