"""The ``kvserve bench compare`` presets: which variants run on which workload, the
table's figures and each preset's claim (:class:`Target`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvserve.bench.workloads import WorkloadSpec


@dataclass(frozen=True)
class Variant:
    """One configuration: ``backend`` "kvserve" (a server with ``engine_args``) or
    "hf" (the in-process transformers static-batching baseline).

    ``threads``: torch threads per server process (``OMP_NUM_THREADS``; None: the
    default). ``prefill_args``: when not None, a prefill worker runs beside the
    server (``--kv-role prefill`` plus these args) and the server is its decode
    worker (``--kv-role decode --kv-prefill-peers ...``)."""

    name: str
    engine_args: tuple[str, ...] = ()
    backend: Literal["kvserve", "hf"] = "kvserve"
    threads: int | None = None
    prefill_args: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Figure:
    """A table column: ``key`` is a summary key ("output_throughput") or
    "<tag>/<key>" for a per-tag figure ("decode/p99_itl_ms")."""

    key: str
    label: str
    higher_is_better: bool = False


@dataclass(frozen=True)
class Target:
    """The preset's claim: figure(variant) / figure(reference) <= bound (``at_most``)
    or >= bound (not ``at_most``)."""

    figure: str
    variant: str
    reference: str
    bound: float
    at_most: bool

    def describe(self) -> str:
        op = "<=" if self.at_most else ">="
        return f"{self.figure}: {self.variant} / {self.reference} {op} {self.bound}"

    def check(self, values: dict[str, dict[str, float | None]]) -> tuple[float | None, bool | None]:
        """(ratio, met) from a ``figure_values`` table; (None, None) when unmeasured."""
        r = ratio(
            values.get(self.variant, {}).get(self.figure),
            values.get(self.reference, {}).get(self.figure),
        )
        if r is None:
            return None, None
        return r, (r <= self.bound if self.at_most else r >= self.bound)


@dataclass(frozen=True)
class ComparePreset:
    name: str
    description: str
    workload: WorkloadSpec
    variants: tuple[Variant, ...]
    reference: str
    figures: tuple[Figure, ...]
    request_rate: float = math.inf
    max_concurrency: int | None = None
    target: Target | None = None
    num_warmup: int = 1
    more_targets: tuple[Target, ...] = ()


THROUGHPUT = Figure("output_throughput", "output tok/s", higher_is_better=True)
REQ_THROUGHPUT = Figure("request_throughput", "req/s", higher_is_better=True)
MEAN_TTFT = Figure("mean_ttft_ms", "mean TTFT ms")
P99_TTFT = Figure("p99_ttft_ms", "p99 TTFT ms")
MEAN_TPOT = Figure("mean_tpot_ms", "mean TPOT ms")
P99_ITL = Figure("p99_itl_ms", "p99 ITL ms")
HIT_RATE = Figure("prefix_cache_hit_rate", "prefix hit rate", higher_is_better=True)

# ``routing``: every variant is a 2-replica Ray Serve cluster (``--replicas 2``, one
# thread each on a 2-core machine) with the same small KV cache per replica, so
# where a tenant's prefix lives decides both its hit rate and its TTFT.
# 576 blocks (9 prefixes of 1024 tokens) per replica: the 16 tenants' prefixes fit in
# the two caches together, not in one.
_CLUSTER = ("--replicas", "2", "--num-kv-blocks", "576", "--max-model-len", "2048")

# The step-time budget's comparisons (issue 23): the engine's old defaults, the old
# README flags, and today's defaults (a time budget per step with decodes). The old
# configurations turn the time budget off to be what they were.
_BUDGET_VARIANTS = (
    Variant("old-default", ("--max-num-batched-tokens", "512", "--max-step-ms", "0")),
    Variant(
        "readme-flags",
        (
            "--max-num-batched-tokens",
            "2048",
            "--prefill-budget-with-decodes",
            "1024",
            "--max-step-ms",
            "0",
        ),
    ),
    Variant("new-default"),
)

PRESETS: dict[str, ComparePreset] = {
    "interference": ComparePreset(
        name="interference",
        description="short chats streaming while 2.5-3k-token documents arrive (42 requests, "
        "one in seven a document, Poisson 3 req/s; shaped like the peer interference.jsonl): "
        "old default vs old README flags vs the step-time budget",
        workload=WorkloadSpec(kind="chat-interference", num_requests=42),
        variants=_BUDGET_VARIANTS,
        reference="old-default",
        figures=(
            THROUGHPUT,
            MEAN_TTFT,
            P99_ITL,
            Figure("chat/p99_itl_ms", "chat p99 ITL ms"),
            Figure("doc/mean_ttft_ms", "doc mean TTFT ms"),
            MEAN_TPOT,
        ),
        request_rate=3.0,
        target=Target("p99_itl_ms", "new-default", "readme-flags", 0.8, at_most=True),
    ),
    "multiturn": ComparePreset(
        name="multiturn",
        description="12 conversations of 5 turns sent as 60 independent requests, 24 in flight "
        "(each turn a prefix hit on the one before; shaped like the peer multiturn.jsonl): "
        "old default vs old README flags vs the step-time budget",
        workload=WorkloadSpec(kind="chat-multiturn", num_requests=60, turns=5),
        variants=_BUDGET_VARIANTS,
        reference="old-default",
        figures=(THROUGHPUT, MEAN_TTFT, P99_ITL, MEAN_TPOT, HIT_RATE),
        max_concurrency=24,
    ),
    "random-c16": ComparePreset(
        name="random-c16",
        description="random 512 in / 128 out, 32 requests, 16 in flight (the peer random row): "
        "old default vs old README flags vs the step-time budget",
        workload=WorkloadSpec(kind="random", num_requests=32, input_len=512, output_len=128),
        variants=_BUDGET_VARIANTS,
        reference="old-default",
        figures=(THROUGHPUT, MEAN_TTFT, P99_ITL, MEAN_TPOT),
        max_concurrency=16,
        target=Target("output_throughput", "new-default", "old-default", 1.2, at_most=False),
    ),
    "shared-prefix-c16": ComparePreset(
        name="shared-prefix-c16",
        description="2 shared 1,024-token prefixes + 64 unique tokens -> 64, 32 requests, 16 in "
        "flight (the peer prefix_repetition row): the short-prompt step target off vs on",
        workload=WorkloadSpec(
            kind="shared-prefix",
            num_requests=32,
            prefix_len=1024,
            num_prefixes=2,
            input_len=64,
            output_len=64,
        ),
        variants=(Variant("short-off", ("--short-prompt-step-ms", "0")), Variant("new-default")),
        reference="short-off",
        figures=(THROUGHPUT, MEAN_TTFT, P99_ITL, MEAN_TPOT),
        max_concurrency=16,
        target=Target("p99_itl_ms", "new-default", "short-off", 0.5, at_most=True),
    ),
    "prefix": ComparePreset(
        name="prefix",
        description="shared-prefix workload (P=1024, U=64, O=64, 32 requests): prefix caching on vs off",
        workload=WorkloadSpec(
            kind="shared-prefix",
            num_requests=32,
            prefix_len=1024,
            input_len=64,
            output_len=64,
            num_prefixes=2,
        ),
        variants=(
            Variant("caching-off", ("--no-enable-prefix-caching",)),
            Variant("caching-on", ("--enable-prefix-caching",)),
        ),
        reference="caching-off",
        figures=(MEAN_TTFT, P99_TTFT, THROUGHPUT, HIT_RATE),
        # Two in flight: the first request of each group computes its prefix in both
        # variants; with more in flight at t=0 the later requests of the cold first
        # wave queue behind those prefills and the mean mostly measures that wave.
        max_concurrency=2,
        target=Target("mean_ttft_ms", "caching-on", "caching-off", 0.2, at_most=True),
    ),
    "chunking": ComparePreset(
        name="chunking",
        description="8 streaming decodes while 2,048-token prompts arrive: chunked prefill (budget 256) vs monolithic",
        workload=WorkloadSpec(
            kind="interference",
            num_decodes=8,
            input_len=64,
            output_len=256,
            num_long_prompts=4,
            long_prompt_len=2048,
            long_prompt_start_s=0.5,
            long_prompt_gap_s=1.5,
        ),
        variants=(
            Variant(
                "monolithic", ("--scheduler-policy", "mixed", "--max-num-batched-tokens", "4096")
            ),
            Variant(
                "chunked-256", ("--scheduler-policy", "mixed", "--max-num-batched-tokens", "256")
            ),
        ),
        reference="monolithic",
        figures=(
            Figure("decode/p99_itl_ms", "decode p99 ITL ms"),
            Figure("decode/mean_itl_ms", "decode mean ITL ms"),
            Figure("prefill/mean_ttft_ms", "long-prompt mean TTFT ms"),
            THROUGHPUT,
        ),
        target=Target("decode/p99_itl_ms", "chunked-256", "monolithic", 0.35, at_most=True),
    ),
    "disagg": ComparePreset(
        name="disagg",
        description="8 streaming decodes while 2,048-token prompts arrive: one process with "
        "2 threads vs a prefill worker + a decode worker with 1 thread each (KV streamed per "
        "chunk, or sent once at the end)",
        workload=WorkloadSpec(
            kind="interference",
            num_decodes=8,
            input_len=64,
            output_len=256,
            num_long_prompts=4,
            long_prompt_len=2048,
            long_prompt_start_s=0.5,
            long_prompt_gap_s=1.5,
        ),
        variants=(
            Variant("colocated-2t", threads=2),
            Variant("disagg-stream-1t+1t", threads=1, prefill_args=("--kv-stream-chunks",)),
            Variant("disagg-at-end-1t+1t", threads=1, prefill_args=("--no-kv-stream-chunks",)),
        ),
        reference="colocated-2t",
        figures=(
            Figure("decode/p99_itl_ms", "decode p99 ITL ms"),
            Figure("decode/mean_itl_ms", "decode mean ITL ms"),
            Figure("prefill/mean_ttft_ms", "long-prompt mean TTFT ms"),
            THROUGHPUT,
            Figure("kv_transfer_mb_per_s", "transfer MB/s", higher_is_better=True),
            Figure("kv_hidden_share", "hidden share (>=2048 tok)", higher_is_better=True),
            Figure("kv_bytes_per_token", "bytes/token measured"),
            Figure("kv_nominal_bytes_per_token", "bytes/token nominal"),
        ),
        target=Target(
            "decode/p99_itl_ms", "disagg-stream-1t+1t", "colocated-2t", 0.5, at_most=True
        ),
    ),
    "policy": ComparePreset(
        name="policy",
        description="random workload (512 in / 128 out, 32 requests at 4 req/s): mixed vs separated scheduling",
        workload=WorkloadSpec(
            kind="random", num_requests=32, input_len=512, output_len=128, range_ratio=0.25
        ),
        # max_model_len 1024 covers the workload (at most 640 + 160 tokens): the separated
        # policy admits only as many requests as fit at max_model_len, so at the default
        # 8192 its KV admission control would hold it to ~2 running requests.
        variants=(
            Variant("mixed", ("--scheduler-policy", "mixed", "--max-model-len", "1024")),
            Variant("separated", ("--scheduler-policy", "separated", "--max-model-len", "1024")),
        ),
        reference="mixed",
        figures=(THROUGHPUT, MEAN_TTFT, P99_TTFT, MEAN_TPOT, P99_ITL),
        request_rate=4.0,
        max_concurrency=16,
    ),
    "throughput": ComparePreset(
        name="throughput",
        description="random 512 in / 128 out, 32 requests, concurrency 16: kvserve vs HF transformers batch 8",
        workload=WorkloadSpec(kind="random", num_requests=32, input_len=512, output_len=128),
        variants=(Variant("hf-batch8", backend="hf"), Variant("kvserve")),
        reference="hf-batch8",
        figures=(THROUGHPUT, REQ_THROUGHPUT, MEAN_TTFT, MEAN_TPOT),
        max_concurrency=16,
        target=Target("output_throughput", "kvserve", "hf-batch8", 2.5, at_most=False),
    ),
    "routing": ComparePreset(
        name="routing",
        description="multi-tenant (16 system prompts of 1024 tokens, Zipf 0.6, Poisson 0.6 req/s, "
        "128 requests, 32 in / 16 out) on 2 Ray Serve replicas of 576 KV blocks: prefix-aware vs "
        "round-robin vs least-loaded routing",
        workload=WorkloadSpec(
            kind="multi-tenant",
            num_requests=128,
            prefix_len=1024,
            num_prefixes=16,
            input_len=32,
            output_len=16,
            zipf_s=0.6,
        ),
        variants=(
            Variant("round-robin", (*_CLUSTER, "--routing", "round-robin")),
            Variant("least-loaded", (*_CLUSTER, "--routing", "least-loaded")),
            Variant("prefix-aware", (*_CLUSTER, "--routing", "prefix-aware")),
        ),
        reference="round-robin",
        figures=(HIT_RATE, MEAN_TTFT, P99_TTFT, THROUGHPUT, REQ_THROUGHPUT),
        request_rate=0.6,
        max_concurrency=32,
        target=Target("mean_ttft_ms", "prefix-aware", "round-robin", 0.5, at_most=True),
        more_targets=(
            Target("prefix_cache_hit_rate", "prefix-aware", "round-robin", 1.5, at_most=False),
        ),
    ),
}


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference, or None when either is missing or the reference is 0."""
    if value is None or reference is None or reference == 0:
        return None
    return value / reference
