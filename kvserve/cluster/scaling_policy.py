"""kvserve's Ray Serve autoscaling policy: Ray's ongoing-requests rule plus the
engines' own queue depth and KV usage, which each replica reports
(``EngineReplica.record_autoscaling_stats``: ``kvserve_waiting``, ``kvserve_kv_usage``).

    n = running replicas        T = --target-ongoing-requests
    S = the engine's --max-num-seqs        U = --target-kv-usage (0 < U <= 1)
    per replica i, each averaged by Ray over the look-back window:
      w_i  requests waiting in its engine (accepted, not running yet)
      u_i  fraction of its KV blocks held by requests (the reusable prefix cache
           is free space, not usage)

    desired = max( ongoing / T,                       Ray's own rule
                   sum(u_i) / U,                      the KV in use, at U per replica
                   n + sum(w_i) / S  if sum(w_i) >= 1 requests wait: one replica
                                     else 0 )         more per S of them (rounded up)

``ongoing`` is Ray's count (requests at the replicas plus those queued at the
ingress's handle). Ray then rounds up, applies ``--upscale-delay`` /
``--downscale-delay`` (the desired size must hold that long) and clamps to
``--min-replicas`` / ``--max-replicas``. Why three terms: with the default ``T`` =
``S`` Ray's rule adds a replica only once every replica holds more than a full batch;
an engine whose KV fills first makes requests wait with fewer than ``T`` ongoing
(waiting term), and long contexts can hold most of the KV with few requests (KV
term). A replica that has not reported yet counts as 0 waiting, 0 usage.

Rules: this module imports nothing of kvserve or Ray at module level. Ray pickles it
by value into its controller, so the controller needs neither kvserve nor this file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

WAITING = "kvserve_waiting"
KV_USAGE = "kvserve_kv_usage"
DEFAULT_TARGET_KV_USAGE = 0.8


class EnginePressurePolicy:
    """The policy (module docstring); Ray builds it once with ``policy_kwargs`` and
    calls it every control-loop tick with an ``AutoscalingContext``. ValueError for a
    bad argument."""

    def __init__(self, max_num_seqs: int, target_kv_usage: float = DEFAULT_TARGET_KV_USAGE):
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"invalid max_num_seqs {max_num_seqs!r}: use an int >= 1")
        u = target_kv_usage
        if isinstance(u, bool) or not isinstance(u, int | float) or not 0 < u <= 1:
            raise ValueError(
                f"invalid --target-kv-usage {u!r}: use a fraction in (0, 1] (e.g. 0.8)"
            )
        self.max_num_seqs = max_num_seqs
        self.target_kv_usage = float(u)

    def desired(
        self,
        num_replicas: int,
        ongoing: float,
        target_ongoing: float,
        waiting: Iterable[float],
        kv_usage: Iterable[float],
    ) -> tuple[float, dict[str, float]]:
        """The desired size (a float; Ray rounds it up) and each term of the rule."""
        total_waiting = sum(_finite(w) for w in waiting)
        terms = {
            "ongoing": _finite(ongoing) / target_ongoing,
            "kv": sum(min(1.0, _finite(u)) for u in kv_usage) / self.target_kv_usage,
            "waiting": (
                num_replicas + total_waiting / self.max_num_seqs if total_waiting >= 1 else 0.0
            ),
        }
        return max(terms.values()), terms

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        n = int(ctx.current_num_replicas)
        if n == 0:  # Ray's wrapper starts a replica on the first request itself
            return float(ctx.target_num_replicas), {}
        running = set(ctx.running_replicas)
        metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
        waiting = [v for r, v in metrics.get(WAITING, {}).items() if r in running]
        usage = [v for r, v in metrics.get(KV_USAGE, {}).items() if r in running]
        desired, terms = self.desired(
            n,
            float(ctx.total_num_requests),
            float(ctx.config.get_target_ongoing_requests()),
            waiting,
            usage,
        )
        return desired, {"kvserve_terms": terms}


def _finite(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) and x > 0 else 0.0
