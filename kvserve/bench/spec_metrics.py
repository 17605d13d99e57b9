"""Speculative-decoding figures of a benchmark run, from the server's ``/metrics``
read before and after it (kvserve's ``kvserve:spec_decode_*`` or vLLM's
``vllm:spec_decode_*`` counters)."""

from __future__ import annotations

from typing import Any

_PREFIXES = ("kvserve:", "vllm:")
_NAMES = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def parse_spec_counters(metrics_text: str) -> dict[str, Any] | None:
    """``{"drafts", "draft_tokens", "accepted_tokens", "per_pos": {pos: n}}`` summed
    over label sets; None when the server exports no speculative-decoding counter or
    the text is not Prometheus format."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    try:
        families = list(text_string_to_metric_families(metrics_text))
    except Exception:
        return None
    for family in families:
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            for prefix in _PREFIXES:
                if not name.startswith(prefix + "spec_decode_"):
                    continue
                short = name[len(prefix + "spec_decode_") :]
                if short == "num_accepted_tokens_per_pos":
                    pos = int(sample.labels.get("position", 0))
                    per_pos[pos] = per_pos.get(pos, 0.0) + float(sample.value)
                elif short in _NAMES:
                    totals[short] = totals.get(short, 0.0) + float(sample.value)
    if not totals:
        return None
    return {
        "drafts": totals.get("num_drafts", 0.0),
        "draft_tokens": totals.get("num_draft_tokens", 0.0),
        "accepted_tokens": totals.get("num_accepted_tokens", 0.0),
        "per_pos": per_pos,
    }


def spec_delta(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The run's drafts, draft tokens, accepted tokens, acceptance rate (accepted /
    draft tokens), mean acceptance length (1 + accepted / drafts) and the acceptance
    rate per draft position (accepted at position i / drafts)."""
    if after is None:
        return None
    before = before or {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "per_pos": {}}
    drafts = after["drafts"] - before["drafts"]
    draft_tokens = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    per_pos = {
        pos: (n - before["per_pos"].get(pos, 0.0)) / drafts if drafts > 0 else None
        for pos, n in sorted(after["per_pos"].items())
    }
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts > 0 else None,
        "acceptance_rate_per_pos": [per_pos[p] for p in sorted(per_pos)],
    }
