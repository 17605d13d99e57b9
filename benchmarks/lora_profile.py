"""Where the mixed-adapter time goes (issue 40), not a test: times ``forward_native``
(prefill forwards vs decode steps, with and without adapter rows) and every
``LoRAWeights.apply`` call with ``perf_counter`` wrappers, for 16 streams all on the
base model and then 16 on a random one of 8 rank-16 adapters or the base::

    .venv/bin/python benchmarks/lora_profile.py
"""

from __future__ import annotations

import collections
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.lora_adapters import make_adapter  # noqa: E402

import kvserve.lora.weights as lora_weights  # noqa: E402
import kvserve.model.llama as llama  # noqa: E402
import kvserve.model.llama_native as llama_native  # noqa: E402
from kvserve import LLM, LoRARequest, SamplingParams  # noqa: E402

ACC: collections.defaultdict[str, float] = collections.defaultdict(float)
COUNT: collections.Counter[str] = collections.Counter()
_apply = lora_weights.LoRAWeights.apply
_forward = llama_native.forward_native


def _kind(rows: int) -> str:
    return "decode" if rows <= 32 else "prefill"


def timed_apply(self: Any, layer: int, f: str, x: Any, y: Any, batch: Any) -> None:
    t0 = time.perf_counter()
    _apply(self, layer, f, x, y, batch)
    key = f"apply {_kind(x.shape[0])} {f}"
    ACC[key] += time.perf_counter() - t0
    COUNT[key] += 1


def timed_forward(*args: Any, **kwargs: Any) -> Any:
    t0 = time.perf_counter()
    out = _forward(*args, **kwargs)
    lora = args[6] if len(args) > 6 else kwargs.get("lora")
    key = f"forward {_kind(args[1].shape[0])} {'lora' if lora is not None else 'base'}"
    ACC[key] += time.perf_counter() - t0
    COUNT[key] += 1
    return out


def main() -> None:
    lora_weights.LoRAWeights.apply = timed_apply  # type: ignore[method-assign]
    llama.forward_native = timed_forward
    rng = random.Random(0)
    llm = LLM(
        None, enable_lora=True, max_loras=10, max_lora_rank=16, max_model_len=700, max_num_seqs=16
    )
    hf_config = llm.engine.loaded.hf_config

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]

    with tempfile.TemporaryDirectory() as tmp:
        reqs = [
            LoRARequest(
                f"a{i}", i + 1, str(make_adapter(Path(tmp) / f"a{i}", hf_config, rank=16, seed=i))
            )
            for i in range(8)
        ]
        options: list[LoRARequest | None] = [None, *reqs]
        choices = [rng.choice(options) for _ in range(16)]
        warm = SamplingParams(max_tokens=2)
        llm.generate(
            prompt_token_ids=prompts(len(options), 8),
            sampling_params=warm,
            use_tqdm=False,
            lora_request=options,
        )
        ACC.clear()
        COUNT.clear()
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        base: list[LoRARequest | None] = [None] * 16
        for name, chosen in (("base", base), ("mixed", choices)):
            t0 = time.perf_counter()
            llm.generate(
                prompt_token_ids=prompts(16, 256),
                sampling_params=params,
                use_tqdm=False,
                lora_request=chosen,
            )
            print(f"{name}: wall {time.perf_counter() - t0:.3f} s")
    for key in sorted(ACC):
        print(
            f"{key:28s} {ACC[key] * 1e3:9.1f} ms  n={COUNT[key]:5d}  "
            f"each {ACC[key] / COUNT[key] * 1e3:.3f} ms"
        )


if __name__ == "__main__":
    main()
