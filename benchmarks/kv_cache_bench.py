"""Micro-benchmark of the KV cache manager's host-side cost (not a test).

Reports hashing + lookup + allocation time per 1,000 prompt tokens at block 16:
``get_computed_blocks`` (hashes every full block, walks the cache) followed by
``allocate_slots`` (claims hits, pops new blocks), for a cold prompt (no hit) and a
warm one (the whole prefix cached), plus ``cache_blocks`` + ``free`` for reference.
Each figure is the median of several runs; each run times many requests.

    .venv/bin/python benchmarks/kv_cache_bench.py [--prompt-len 4000] [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from kvserve.config import HashAlgo
from kvserve.kv_cache import KVCacheManager, hash_block_tokens
from kvserve.request import Request, SamplingParams

SP = SamplingParams()


def median_us_per_1k(fn: Callable[[], tuple[float, int]], runs: int) -> float:
    """Median over ``runs`` of the timed section's microseconds per 1,000 tokens.

    ``fn`` does its own setup untimed and returns (seconds of the timed section, tokens).
    """
    samples = []
    for _ in range(runs):
        seconds, tokens = fn()
        samples.append(seconds / tokens * 1e9)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=4000)
    ap.add_argument("--requests", type=int, default=50, help="requests timed per run")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    bs, plen, nreq = args.block_size, args.prompt_len, args.requests
    num_blocks = (plen // bs + 2) * (nreq + 2)

    def prompts(tag: int) -> list[list[int]]:
        return [[tag * 1_000_003 + i * 7 + j for j in range(plen)] for i in range(nreq)]

    results: dict[str, dict[str, float]] = {}
    algos: tuple[HashAlgo, ...] = ("sha256", "builtin")
    for algo in algos:

        def new_manager(algo: HashAlgo = algo) -> KVCacheManager:
            return KVCacheManager(
                num_blocks, bs, plen + 16, hash_algo=algo, model_fingerprint="bench"
            )

        def hashing_only(algo: HashAlgo = algo) -> tuple[float, int]:
            toks = prompts(0)
            t0 = time.perf_counter()
            for p in toks:
                parent = None
                for i in range(plen // bs):
                    extra = (("model", "bench"),) if i == 0 else ()
                    parent = hash_block_tokens(parent, p[i * bs : (i + 1) * bs], extra, algo)
            return time.perf_counter() - t0, nreq * plen

        def cold(new_manager: Callable[[], KVCacheManager] = new_manager) -> tuple[float, int]:
            m = new_manager()
            reqs = [Request(f"r{i}", p, SP) for i, p in enumerate(prompts(1))]
            t0 = time.perf_counter()
            for r in reqs:
                blocks, hit = m.get_computed_blocks(r)
                assert m.allocate_slots(r, r.num_tokens - hit, blocks, hit) is not None
            return time.perf_counter() - t0, nreq * plen

        def warm(new_manager: Callable[[], KVCacheManager] = new_manager) -> tuple[float, int]:
            m = new_manager()
            shared = prompts(2)[0]
            first = Request("first", shared, SP)
            m.allocate_slots(first, plen)
            first.num_computed_tokens = plen
            m.cache_blocks(first, plen)
            m.free(first)
            reqs = [Request(f"r{i}", list(shared), SP) for i in range(nreq)]
            t0 = time.perf_counter()
            for r in reqs:
                blocks, hit = m.get_computed_blocks(r)
                assert hit == (plen - 1) // bs * bs
                assert m.allocate_slots(r, r.num_tokens - hit, blocks, hit) is not None
            return time.perf_counter() - t0, nreq * plen

        def cache_and_free(
            new_manager: Callable[[], KVCacheManager] = new_manager,
        ) -> tuple[float, int]:
            m = new_manager()
            reqs = [Request(f"r{i}", p, SP) for i, p in enumerate(prompts(3))]
            for r in reqs:
                blocks, hit = m.get_computed_blocks(r)
                m.allocate_slots(r, r.num_tokens - hit, blocks, hit)
                r.num_computed_tokens = r.num_tokens
            t0 = time.perf_counter()
            for r in reqs:
                m.cache_blocks(r, r.num_tokens)
                m.free(r)
            return time.perf_counter() - t0, nreq * plen

        results[algo] = {
            "hash only": median_us_per_1k(hashing_only, args.runs),
            "cold: hash+lookup+allocate": median_us_per_1k(cold, args.runs),
            "warm: hash+lookup+claim hits": median_us_per_1k(warm, args.runs),
            "cache_blocks+free": median_us_per_1k(cache_and_free, args.runs),
        }

    print(
        f"KV cache manager, block_size={bs}, prompt_len={plen}, {nreq} requests/run, "
        f"median of {args.runs} runs; microseconds per 1,000 prompt tokens"
    )
    print(f"{'':32s}{'sha256':>10s}{'builtin':>10s}")
    for key in results["sha256"]:
        print(f"{key:32s}{results['sha256'][key]:10.1f}{results['builtin'][key]:10.1f}")


if __name__ == "__main__":
    main()
