"""The batch-invariance check across disaggregated serving (docs/determinism.md,
``kvserve bench invariance --disagg``): each prompt alone through ``LLM`` against the
same prompt through a prefill worker + decode worker, two ``kvserve serve`` processes
on 127.0.0.1 with the KV sent over the wire (:func:`check_disaggregated`).
"""

from __future__ import annotations

from typing import Any

from kvserve.bench.process import free_port, wait_healthy
from kvserve.request import SamplingParams


def _alone_signatures(
    prompts: list[list[int]], dtype: str, max_tokens: int, opts: dict[str, Any]
) -> tuple[list[tuple[Any, ...]], Any]:
    """Greedy (text, sampled logprobs, sorted top-3 logprobs) of each prompt run alone
    through ``LLM``; also returns the LLM's runner (its mode)."""
    from kvserve.entrypoints.llm import LLM

    llm = LLM(dtype=dtype, **opts)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3)
    out = []
    for i, p in enumerate(prompts):
        (o,) = llm.generate(
            prompt_token_ids=[p], sampling_params=[sp], use_tqdm=False, cache_salt=f"a{i}"
        )
        c = o.outputs[0]
        lps = c.logprobs or []
        out.append(
            (
                c.text,
                tuple(lp.sampled_logprob for lp in lps),
                tuple(tuple(sorted(lp.top_logprobs)) for lp in lps),
            )
        )
    return out, llm.engine.runner


def check_disaggregated(
    prompts: list[list[int]],
    *,
    dtype: str = "bfloat16",
    max_tokens: int = 8,
    max_model_len: int = 2304,
    remote_min_tokens: int = 16,
    log_dir: str | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Each prompt alone through ``LLM`` vs through a prefill worker + decode worker
    (two ``kvserve serve`` processes on 127.0.0.1, the KV sent over the wire; prompts
    of at least ``remote_min_tokens`` are prefilled remotely): greedy text, sampled
    logprobs and top-3 logprobs compared exactly. Both workers and the reference run
    the automatic mode with the same settings. Returns ``{"compared", "identical",
    "guaranteed", "mismatches", "remote_tokens", "reach"}``; "guaranteed" counts the
    prompts whose prompt + ``max_tokens`` fit the reach. The workers are stopped on
    return (and on any error)."""
    import os
    import subprocess
    import sys
    import tempfile

    import httpx

    opts = {"max_model_len": max_model_len}
    alone, runner = _alone_signatures(prompts, dtype, max_tokens, opts)
    reach = (
        max_model_len
        if getattr(runner, "batch_invariant", False)
        else int(getattr(runner, "invariant_max_context", 0))
    )
    logs = log_dir or tempfile.mkdtemp(prefix="kvserve-inv-disagg-")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("KVSERVE_API_KEY", None)
    common = ["--dtype", dtype, "--max-model-len", str(max_model_len), "--no-access-log"]
    kv_port = free_port()
    roles = {
        "prefill": ["--kv-role", "prefill", "--kv-address", f"127.0.0.1:{kv_port}"],
        "decode": [
            "--kv-role",
            "decode",
            "--kv-prefill-peers",
            f"127.0.0.1:{kv_port}",
            "--kv-remote-min-tokens",
            str(remote_min_tokens),
            "--kv-load-failure-policy",
            "fail",
        ],
    }
    procs: dict[str, tuple[Any, str]] = {}
    try:
        for role, extra in roles.items():
            port = free_port()
            cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--host"]
            cmd += ["127.0.0.1", "--port", str(port), *common, *extra]
            log = open(os.path.join(logs, f"{role}.log"), "wb")  # noqa: SIM115
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            log.close()
            procs[role] = (proc, f"http://127.0.0.1:{port}")
        for proc, url in procs.values():
            wait_healthy(url, proc, timeout_s, what="worker")
        url = procs["decode"][1]
        result: dict[str, Any] = {"compared": 0, "identical": 0, "guaranteed": 0}
        result["mismatches"] = []
        for i, p in enumerate(prompts):
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "logprobs": 3}
            r = httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)
            r.raise_for_status()
            ch = r.json()["choices"][0]
            lp = ch.get("logprobs") or {}
            text, sampled = ch["text"], tuple(lp.get("token_logprobs") or ())
            tops = [tuple(sorted(d.values())) for d in lp.get("top_logprobs") or ()]
            want_text, want_sampled, want_tops = alone[i]
            # top_logprobs maps token text -> logprob, so two top tokens with the same
            # text collapse into one entry: each value must be one of the alone ones
            same = (
                text == want_text
                and sampled == want_sampled
                and len(tops) == len(want_tops)
                and all(set(t) <= set(w) for t, w in zip(tops, want_tops, strict=True))
            )
            result["compared"] += 1
            within = len(p) + max_tokens <= reach
            result["guaranteed"] += int(within)
            if same:
                result["identical"] += 1
            elif within:
                result["mismatches"].append(
                    f"disagg: prompt {i} ({len(p)} tokens): got {text!r} {sampled} {tops}, "
                    f"alone {want_text!r} {want_sampled} {want_tops}"
                )
        metrics = httpx.get(url + "/metrics", timeout=10).text
        key = 'kvserve:prompt_tokens_by_source_total{model_name="'
        remote = 0.0
        for line in metrics.splitlines():
            if line.startswith(key.split("{")[0]) and "external_kv_transfer" in line:
                remote += float(line.rsplit(" ", 1)[1])
        result["remote_tokens"] = remote
        result["reach"] = reach
        return result
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


# ------------------------------------------------------------------------------ CLI
