"""What ``kvserve bench compare disagg`` adds to a run: the prefill worker beside a
decode-worker variant, and the KV transfer figures read from both workers' /metrics.

Figures (added to the report's summary):

- ``kv_transfer_mb_per_s``: MB received / seconds the link carried chunks
- ``kv_hidden_share``: for prompts >= 2,048 tokens, 1 - exposed / busy, where
  exposed is the transfer time after the prompt's last prefill step (see
  ``kvserve.kv_transfer.stats``)
- ``kv_bytes_per_token``: bytes received / prompt tokens whose KV came over the wire
- ``kv_nominal_bytes_per_token``: 2 x layers x KV heads x head dim x dtype bytes
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

TRANSFER_FIGURES = (
    "kv_transfer_mb_per_s",
    "kv_hidden_share",
    "kv_bytes_per_token",
    "kv_nominal_bytes_per_token",
)


def scrape_metrics(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """GET /metrics (with ``headers``) as ``name{label=value,...}`` (model_name left
    out) -> value."""
    text = httpx.get(base_url + "/metrics", timeout=10, headers=headers).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = {k: v for k, v in sample.labels.items() if k != "model_name"}
            key = sample.name
            if extra:
                key += "{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}"
            out[key] = sample.value
    return out


def transfer_figures(decode: dict[str, float], prefill: dict[str, float]) -> dict[str, Any]:
    """The figures above from the two workers' scraped metrics."""
    received = decode.get("kvserve:kv_transfer_bytes_total{direction=received}", 0.0)
    busy = decode.get("kvserve:kv_transfer_busy_seconds_total", 0.0)
    long_busy = decode.get("kvserve:kv_transfer_long_busy_seconds_total", 0.0)
    long_exposed = decode.get("kvserve:kv_transfer_long_exposed_seconds_total", 0.0)
    external = decode.get("kvserve:prompt_tokens_by_source_total{source=external_kv_transfer}", 0.0)
    return {
        "kv_transfer_mb_per_s": received / busy / 1e6 if busy > 0 else None,
        "kv_hidden_share": 1.0 - long_exposed / long_busy if long_busy > 0 else None,
        "kv_bytes_per_token": received / external if external > 0 else None,
        "kv_nominal_bytes_per_token": decode.get("kvserve:kv_transfer_nominal_bytes_per_token"),
        "kv_bytes_sent": prefill.get("kvserve:kv_transfer_bytes_total{direction=sent}"),
        "kv_bytes_received": received,
        "kv_transfer_failures": decode.get("kvserve:kv_transfer_failures_total"),
        "kv_long_prompts": decode.get("kvserve:kv_transfer_long_prompts_total"),
        "prompt_tokens_external": external,
        "prompt_tokens_local_compute": decode.get(
            "kvserve:prompt_tokens_by_source_total{source=local_compute}"
        ),
    }
