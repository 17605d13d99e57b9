"""``SpeculativeConfig``: what ``--speculative-config JSON`` and
``LLM(speculative_config={...})`` accept, spelled as vLLM spells it.

    {"method": "ngram", "num_speculative_tokens": 4,
     "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "<path or named model>", "num_speculative_tokens": 3}

Optional keys (both methods): ``disable_by_batch_size`` (vLLM's name: no proposals
while more than this many requests decode; default unset), ``adaptive`` (default
true: the per-request and engine-wide rule of :mod:`kvserve.spec_decode.controller`;
false proposes ``num_speculative_tokens`` whenever the proposer has them) and
``step_cost_per_token`` (the controller's cost model: the time one more token adds
to a step, as a fraction of a one-token step; measured default, see the docs).
Draft models only: ``draft_dtype``, ``quantization`` and ``share_target_kv`` (default
true: a draft with the target's checkpoint copies the target's K/V rows instead of
prefilling the prompt itself, :mod:`kvserve.spec_decode.draft_model`).
Unknown keys and bad values raise ValueError naming the key and a valid example.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
# Cost model default (docs/speculative-decoding.md "Never worse"): on the default model
# one more token in a decode step costs about this fraction of a one-token step.
DEFAULT_STEP_COST_PER_TOKEN = 0.15
_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
    "adaptive",
    "step_cost_per_token",
    "draft_dtype",
    "quantization",
    "share_target_kv",
}
_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def _err(key: str, value: object, rule: str) -> ValueError:
    return ValueError(
        f"invalid speculative_config {key}={value!r}: {rule} (for example: {_EXAMPLE})"
    )


def _int(key: str, value: object, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _err(key, value, f"use an integer from {lo} to {hi}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative-decoding setup (build it with :meth:`from_value`)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_dtype: str | None = None
    quantization: str = "auto"
    disable_by_batch_size: int | None = None
    adaptive: bool = True
    step_cost_per_token: float = DEFAULT_STEP_COST_PER_TOKEN
    share_target_kv: bool = True

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a config, a dict or a JSON string (as on the command line)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"invalid --speculative-config: not JSON ({e}); for example: {_EXAMPLE}"
                ) from None
        if not isinstance(value, dict):
            raise ValueError(
                f"invalid speculative_config {value!r}: use a JSON object, e.g. {_EXAMPLE}"
            )
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(
                f"invalid speculative_config: unknown key(s) {', '.join(unknown)}; valid keys "
                f"are {', '.join(sorted(_KEYS))} (for example: {_EXAMPLE})"
            )
        method = value.get("method")
        if method is None and value.get("model") is not None:
            method = "draft_model"
        if method not in METHODS:
            raise _err("method", method, f"use one of {', '.join(METHODS)}")
        if "num_speculative_tokens" not in value:
            raise _err("num_speculative_tokens", None, "it is required")
        k = _int("num_speculative_tokens", value["num_speculative_tokens"], 1, 16)
        lo = _int("prompt_lookup_min", value.get("prompt_lookup_min", 1), 1, 64)
        hi = _int("prompt_lookup_max", value.get("prompt_lookup_max", max(lo, 4)), 1, 64)
        if lo > hi:
            raise _err("prompt_lookup_min", lo, f"must not exceed prompt_lookup_max={hi}")
        model = value.get("model")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise _err("model", model, 'draft_model needs "model": a path or named model')
        if method == "ngram" and model is not None:
            raise _err("model", model, 'ngram takes no model; use "method": "draft_model"')
        disable = value.get("disable_by_batch_size")
        if disable is not None:
            disable = _int("disable_by_batch_size", disable, 1, 1 << 20)
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise _err("adaptive", adaptive, "use true or false")
        cost = value.get("step_cost_per_token", DEFAULT_STEP_COST_PER_TOKEN)
        if (
            not isinstance(cost, int | float)
            or isinstance(cost, bool)
            or not 0.0 <= float(cost) <= 10.0
        ):
            raise _err("step_cost_per_token", cost, "use a number from 0 to 10")
        dtype = value.get("draft_dtype")
        if dtype is not None and dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise _err("draft_dtype", dtype, "use auto, float32, bfloat16 or float16")
        quant = value.get("quantization", "auto")
        if quant not in ("auto", "none", "int8", "int4"):
            raise _err("quantization", quant, "use auto, none, int8 or int4")
        if method == "ngram" and "quantization" in value:
            raise _err("quantization", quant, "only a draft_model has weights to quantize")
        share = value.get("share_target_kv", True)
        if not isinstance(share, bool):
            raise _err("share_target_kv", share, "use true or false")
        if method == "ngram" and "share_target_kv" in value:
            raise _err("share_target_kv", share, "only a draft_model keeps a KV cache")
        return cls(
            method=method,
            num_speculative_tokens=k,
            prompt_lookup_min=lo,
            prompt_lookup_max=hi,
            model=model,
            draft_dtype=dtype,
            quantization=quant,
            disable_by_batch_size=disable,
            adaptive=adaptive,
            step_cost_per_token=float(cost),
            share_target_kv=share,
        )
