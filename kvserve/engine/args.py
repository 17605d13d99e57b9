"""Engine options: one flat set of names shared by ``LLM(...)``, ``kvserve generate``,
``kvserve serve`` and ``kvserve bench compare``, mapped onto the frozen configs.

Every option is validated up front: :func:`build_engine_config` raises ValueError
naming the option, the rule and a valid example, and never half-builds an engine.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from kvserve.config import (
    DEFAULT_MAX_MODEL_LEN,
    AdmissionConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    is_int,
)
from kvserve.engine.device import DEVICES_HELP, resolve_device
from kvserve.lora.config import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    LoRAConfig,
    parse_lora_module,
)
from kvserve.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class _Option:
    name: str
    section: str  # "model" | "cache" | "scheduler" | "admission" | "speculative"
    type: type
    help: str


def _parse_int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of integers such as 128,256,512, got {text!r}"
        ) from e


OPTIONS: tuple[_Option, ...] = (
    _Option(
        "model", "model", str, "HF folder, .gguf file or named default (smollm2-135m-instruct)"
    ),
    _Option(
        "dtype",
        "model",
        str,
        "auto (default: bfloat16 where the CPU has avx512_bf16/AMX, else float32), "
        "float32, bfloat16 or float16",
    ),
    _Option(
        "quantization",
        "model",
        str,
        "auto (default: run a GGUF's Q4_0/Q4_1/Q8_0 weights as they are), none (dequantize "
        "to the model dtype), int8 or int4 (quantize a float checkpoint at load)",
    ),
    _Option("device", "model", str, "torch device: " + DEVICES_HELP),
    _Option(
        "compile",
        "model",
        bool,
        "compile decode steps with torch.compile, one graph per decode bucket, all warmed "
        "at startup (default off)",
    ),
    _Option(
        "batch_invariant",
        "model",
        bool,
        "a request's logits bitwise the same whatever else runs, however it is chunked "
        "or cached, at every length (default: automatic, requests up to 4,096 tokens on "
        "AVX-512 CPUs without AMX and up to 512 elsewhere, where that is cheap; "
        "--no-batch-invariant turns it off; docs/determinism.md)",
    ),
    _Option("max_model_len", "scheduler", int, "longest prompt + output a request may have"),
    _Option("block_size", "cache", int, "tokens per KV block (power of two)"),
    _Option("enable_prefix_caching", "cache", bool, "reuse KV of shared prompt prefixes"),
    _Option("num_kv_blocks", "cache", int, "KV blocks to allocate (overrides kv_cache_memory_gib)"),
    _Option("kv_cache_memory_gib", "cache", float, "GiB of memory for the KV cache"),
    _Option(
        "kv_cache_commit",
        "cache",
        str,
        "eager (default: reserve the KV pool at startup) or lazy (commit its memory as "
        "blocks are first written; the size is a ceiling; --gpu-memory-utilization sets it)",
    ),
    _Option("hash_algo", "cache", str, "prefix-cache block hash: sha256 (default) or builtin"),
    _Option(
        "kv_cache_dtype",
        "cache",
        str,
        "KV cache storage: auto (default: the model dtype), bfloat16, float32, int8 or "
        "fp8_e4m3 (8-bit codes with per-token scales; docs/quantization.md)",
    ),
    _Option(
        "kv_offload_dir",
        "cache",
        str,
        "KV tier beyond RAM: write full prefix-cache blocks to this directory and load "
        "them back on a prefix hit, also after a restart (default off; docs/kv-offload.md)",
    ),
    _Option(
        "kv_offload_gib",
        "cache",
        float,
        "GiB of files kv_offload_dir may hold; least recently used files are deleted past "
        "it (default 10)",
    ),
    _Option("max_num_seqs", "scheduler", int, "most requests running at once"),
    _Option("max_num_batched_tokens", "scheduler", int, "token budget per step"),
    _Option("scheduler_policy", "scheduler", str, "mixed (default) or separated"),
    _Option(
        "long_prefill_token_threshold",
        "scheduler",
        int,
        "cap on one prompt's chunk when several compete (0 = off)",
    ),
    _Option(
        "prefill_budget_with_decodes",
        "scheduler",
        int,
        "mixed policy: most prompt tokens in a step that also decodes, bounding the "
        "inter-token latency (0 = off: max_num_batched_tokens)",
    ),
    _Option(
        "max_step_ms",
        "scheduler",
        float,
        "target milliseconds of a step that also decodes: its prompt tokens are sized by a "
        "cost model fitted at startup and corrected from measured steps (0 = off: token "
        "budgets only)",
    ),
    _Option(
        "short_prompt_step_ms",
        "scheduler",
        float,
        "mixed policy under max_step_ms: target milliseconds of a step that decodes while "
        "its prompt work is only short prompts (each predicted to finish within twice this "
        "long); a long prompt's chunk lifts the step to max_step_ms (0 = off)",
    ),
    _Option(
        "step_cost_cache",
        "scheduler",
        str,
        "the max_step_ms cost model's fit, persisted per machine and model in "
        "~/.cache/kvserve/step_cost: auto (default: reuse it after a short check), "
        "refresh (calibrate now and store), off (calibrate, store nothing)",
    ),
    _Option(
        "step_trace",
        "scheduler",
        str,
        "append one JSON line per step to this file under max_step_ms (measured and "
        "predicted ms, online factors, each row's new tokens and context); off when empty",
    ),
    _Option(
        "batch_wait_ms",
        "admission",
        float,
        "server: after idling, wait until requests stop arriving for this many ms "
        "(at most 8x) before the first step, so a burst starts as one batch (0 = off)",
    ),
    _Option(
        "num_batched_tokens_buckets",
        "scheduler",
        tuple,
        "separated policy: prefill chunk buckets, e.g. 128,256,512",
    ),
    _Option(
        "num_seqs_buckets",
        "scheduler",
        tuple,
        "separated policy: decode batch buckets, e.g. 1,2,4,8",
    ),
    _Option(
        "kv_segment_size",
        "cache",
        int,
        "segment of cached KV read per attention pass: 0, 512, 1024, 2048, 4096",
    ),
    _Option(
        "speculative_config",
        "speculative",
        dict,
        "speculative decoding as JSON, as vLLM spells it, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        "(docs/speculative-decoding.md; default off)",
    ),
    _Option(
        "enable_lora",
        "lora",
        bool,
        "serve LoRA adapters over the base model, mixed in one batch (docs/lora.md)",
    ),
    _Option(
        "lora_modules",
        "lora",
        list,
        "adapters to load at start, NAME=PATH each (PEFT folders); a request selects one "
        "by its model name",
    ),
    _Option("max_loras", "lora", int, "LoRA adapters resident at once (default 8)"),
    _Option("max_lora_rank", "lora", int, "largest LoRA rank accepted (default 16)"),
)
OPTION_NAMES = tuple(o.name for o in OPTIONS)


def build_engine_config(**kwargs: Any) -> EngineConfig:
    """Map flat engine options onto an :class:`EngineConfig` and validate it.

    Unknown names raise TypeError listing the valid ones. ``None`` values mean
    "default". Each option has one section (its one owner). ``max_model_len`` left
    unset stays None in SchedulerConfig and is resolved against the model's own
    context length by the engine (:func:`with_max_model_len`).
    """
    unknown = sorted(set(kwargs) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(
            f"unknown engine option(s) {', '.join(unknown)}; valid options are: {', '.join(OPTION_NAMES)}"
        )
    given = {k: v for k, v in kwargs.items() if v is not None}
    given["device"] = resolve_device(given.get("device"))
    for key in ("num_batched_tokens_buckets", "num_seqs_buckets"):
        if key in given and not isinstance(given[key], tuple):
            value = given[key]
            if isinstance(value, str):
                value = _parse_int_list(value)
            given[key] = tuple(value)
    sections: dict[str, dict[str, Any]] = {
        "model": {},
        "cache": {},
        "scheduler": {},
        "admission": {},
        "lora": {},
    }
    for opt in OPTIONS:
        if opt.name not in given:
            continue
        value = given[opt.name]
        if opt.section == "speculative":
            continue
        sections[opt.section][opt.name] = value
    config = EngineConfig(
        model=ModelConfig(**sections["model"]),
        cache=CacheConfig(**sections["cache"]),
        scheduler=SchedulerConfig(**sections["scheduler"]),
        admission=AdmissionConfig(**sections["admission"]),
        speculative=(
            SpeculativeConfig.from_value(given["speculative_config"])
            if "speculative_config" in given
            else None
        ),
        lora=_lora_config(sections["lora"]),
    )
    config.cache.validate()
    config.admission.validate()
    return config


def _lora_config(options: dict[str, Any]) -> LoRAConfig | None:
    """The LoRA section (None when no LoRA option is set); ValueError when invalid."""
    if not options:
        return None
    modules: list[tuple[str, str]] = []
    given = options.get("lora_modules") or ()
    if isinstance(given, dict):
        given = list(given.items())
    for item in given:
        if isinstance(item, str):
            modules.append(parse_lora_module(item))
        elif isinstance(item, dict):
            modules.append((str(item["name"]), str(item["path"])))
        else:
            name, path = item
            modules.append((str(name), str(path)))
    config = LoRAConfig(
        enable_lora=bool(options.get("enable_lora", bool(modules))),
        max_loras=int(options.get("max_loras", DEFAULT_MAX_LORAS)),
        max_lora_rank=int(options.get("max_lora_rank", DEFAULT_MAX_LORA_RANK)),
        lora_modules=tuple(modules),
    )
    config.validate()
    return config


def with_max_model_len(config: EngineConfig, model_max_len: int) -> EngineConfig:
    """Resolve ``SchedulerConfig.max_model_len`` against the model's context length
    (None: the model's, at most ``DEFAULT_MAX_MODEL_LEN``); validate the cache config
    and the scheduler config (the one validation of an engine's: later ``resolved()``
    calls find it).

    An explicit max_model_len larger than the model allows is refused.
    """
    config.cache.validate()
    requested = config.scheduler.max_model_len
    if requested is None:
        max_len = min(model_max_len, DEFAULT_MAX_MODEL_LEN)
    elif is_int(requested) and requested > model_max_len:
        raise ValueError(
            f"invalid max_model_len={requested}: the model supports at most {model_max_len} tokens "
            f"(for example: max_model_len={min(model_max_len, DEFAULT_MAX_MODEL_LEN)})"
        )
    else:
        max_len = requested
    sched = dataclasses.replace(config.scheduler, max_model_len=max_len).resolved()
    return dataclasses.replace(config, scheduler=sched)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--max-num-batched-tokens`` ... (one flag per engine option)."""
    group = parser.add_argument_group("engine options")
    for opt in OPTIONS:
        flag = "--" + opt.name.replace("_", "-")
        if opt.type is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=opt.help
            )
        elif opt.type is tuple:
            group.add_argument(flag, type=_parse_int_list, default=None, help=opt.help)
        elif opt.type is list:  # NAME=PATH ..., parsed by build_engine_config
            group.add_argument(flag, nargs="+", default=None, metavar="NAME=PATH", help=opt.help)
        elif opt.type is dict:  # JSON text, parsed and validated by build_engine_config
            group.add_argument(flag, type=str, default=None, help=opt.help)
        else:
            group.add_argument(flag, type=opt.type, default=None, help=opt.help)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options set on the command line (others stay at their defaults)."""
    return {
        name: getattr(args, name) for name in OPTION_NAMES if getattr(args, name, None) is not None
    }
