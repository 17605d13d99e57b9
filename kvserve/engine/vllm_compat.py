"""vLLM's engine options that mean something else (or nothing) on kvserve, shared
by ``kvserve serve`` and ``LLM(...)``, and the model's generation-config sampling
defaults (``--generation-config``).

:func:`translate_vllm_options` takes vLLM's option names out of a set of options
and returns kvserve's engine options plus one notice per accepted option saying
what kvserve does instead; a value kvserve cannot honour is a ValueError naming
the alternative:

    tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1
                              accepted (one engine per process); > 1 refused: use
                              ``--replicas N`` (Ray Serve) to scale out
    gpu_memory_utilization=f  the KV cache may grow to ``f`` x the RAM available at
                              start, a ceiling committed as blocks are used
                              (kv_cache_commit="lazy"), unless num_kv_blocks /
                              kv_cache_memory_gib are given
    enforce_eager             accepted: kvserve runs eager unless ``--compile``
    trust_remote_code         accepted: kvserve builds the model itself and runs no
                              code from the model folder
    enable_chunked_prefill    True (default) as kvserve; False = one chunk per
                              prompt (token budget >= max_model_len, no chunk cap)
    tokenizer                 must be the model's folder (kvserve loads the
                              tokenizer that comes with the model)
    swap_space, disable_log_stats   accepted, no effect

(``kv_cache_dtype`` is one of kvserve's own engine options: auto, bfloat16, float32,
int8, fp8_e4m3.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

VLLM_OPTIONS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "gpu_memory_utilization",
    "enforce_eager",
    "trust_remote_code",
    "enable_chunked_prefill",
    "tokenizer",
    "swap_space",
    "disable_log_stats",
)
# Sampling fields a generation_config.json may set, as vLLM reads them.
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
DEFAULT_CHUNKLESS_BUDGET = 8192  # the default max_model_len cap (engine/args.py)


def _ram_available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages / 2**30


def translate_vllm_options(options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(kvserve engine options, notices) from ``options``, which may hold vLLM's
    names (see the module docstring); other names pass through unchanged.
    Raises ValueError for a value kvserve cannot honour."""
    out = {k: v for k, v in options.items() if k not in VLLM_OPTIONS}
    notices: list[str] = []
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = options.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"invalid {name}={value!r}: use 1")
        if value > 1:
            raise ValueError(
                f"{name}={value} cannot be honoured: kvserve runs one engine per process on "
                "CPU and does not shard a model; to serve on several engines use "
                f"--replicas {value} (Ray Serve, one full engine each)"
            )
        notices.append(f"{name}=1: accepted (kvserve runs one engine per process)")
    util = options.get("gpu_memory_utilization")
    if util is not None:
        if not isinstance(util, int | float) or not 0 < util <= 1:
            raise ValueError(
                f"invalid gpu_memory_utilization={util!r}: use a fraction in (0, 1], e.g. 0.5"
            )
        if options.get("num_kv_blocks") is None and options.get("kv_cache_memory_gib") is None:
            gib = round(util * _ram_available_gib(), 2)
            out["kv_cache_memory_gib"] = max(gib, 0.01)
            out.setdefault("kv_cache_commit", "lazy")
            notices.append(
                f"gpu_memory_utilization={util}: kvserve runs on CPU; the KV cache may grow "
                f"to {util} x the RAM available now = {gib} GiB (kv_cache_memory_gib), a "
                "ceiling: its memory is committed as blocks are used "
                f"(kv_cache_commit={out['kv_cache_commit']})"
            )
        else:
            notices.append(
                f"gpu_memory_utilization={util}: ignored, num_kv_blocks / kv_cache_memory_gib "
                "size the KV cache"
            )
    if options.get("enforce_eager"):
        notices.append(
            "enforce_eager: accepted; kvserve runs eager unless --compile (torch.compile) is set"
        )
    if options.get("trust_remote_code"):
        notices.append(
            "trust_remote_code: accepted, no effect; kvserve builds Llama-family models itself "
            "and never runs code from a model folder"
        )
    if options.get("enable_chunked_prefill") is False:
        budget = max(
            options.get("max_num_batched_tokens") or 0,
            options.get("max_model_len") or DEFAULT_CHUNKLESS_BUDGET,
        )
        out["max_num_batched_tokens"] = budget
        out["long_prefill_token_threshold"] = 0
        out["prefill_budget_with_decodes"] = 0
        notices.append(
            "enable_chunked_prefill=False: one chunk per prompt (token budget "
            f"max_num_batched_tokens={budget}, no chunk cap)"
        )
    tokenizer = options.get("tokenizer")
    if tokenizer is not None and tokenizer != options.get("model"):
        raise ValueError(
            f"tokenizer={tokenizer!r} differs from the model: kvserve loads the tokenizer "
            "that comes with the model (its folder or GGUF); drop tokenizer= or point model= "
            "at a folder holding both"
        )
    for name in ("swap_space", "disable_log_stats"):
        if options.get(name) not in (None, False):
            notices.append(f"{name}: accepted, no effect on kvserve")
    return out, notices


def generation_defaults(
    spec: str | None, model_dir: str | os.PathLike[str] | None
) -> dict[str, Any]:
    """Default sampling fields from ``generation_config.json`` (vLLM's
    ``--generation-config``): ``"vllm"`` = none; ``"auto"`` (default) = the model
    folder's file; any other value = a folder holding the file. Only the fields
    in :data:`GENERATION_FIELDS` are read; a missing file under ``auto`` gives
    none, under a folder it is a ValueError."""
    if spec in (None, "auto"):
        if model_dir is None:
            return {}
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return {}
    elif spec == "vllm":
        return {}
    else:
        path = Path(spec).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ValueError(
                f"--generation-config {spec!r}: no generation_config.json in that folder; use "
                "auto (the model's), vllm (no defaults) or a folder that holds one"
            )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    out: dict[str, Any] = {}
    for name in GENERATION_FIELDS:
        value = data.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    return out
