"""``--min-replicas`` / ``--max-replicas``: the engine deployment's size follows its
queue, through Ray Serve's autoscaler (no ray here: plain data and the mapping).

    kvserve flag                  Ray Serve ``autoscaling_config`` field
    --min-replicas M              min_replicas            (M >= 1)
    --max-replicas X              max_replicas            (X >= max(M, 2))
    --replicas N (optional)       initial_replicas        (M <= N <= X; default M)
    --target-ongoing-requests T   target_ongoing_requests (default: the engine's
                                                           max_num_seqs)
    --upscale-delay S             upscale_delay_s         (default 30, Ray's)
    --downscale-delay S           downscale_delay_s       (default 600, Ray's)
    --autoscale-look-back S       look_back_period_s      (default 30, Ray's), and
                                  metrics_interval_s = min(10, S / 3): how often the
                                  ingress's handle and the replicas report

    --target-kv-usage U           policy_kwargs of kvserve's policy (default 0.8)

The policy is kvserve's (``scaling_policy.EnginePressurePolicy``, its docstring has
the rule): the larger of Ray's own ongoing-requests rule (requests routed to the
replicas and not finished, over ``T``), the engines' KV usage (over ``U``) and their
waiting queues (one more replica per ``max_num_seqs`` requests waiting), which each
replica reports through ``record_autoscaling_stats``. Serve adds replicas while the
desired size stays above the current one for ``upscale delay`` seconds and removes
them while it stays below for ``downscale delay`` seconds.

Scaling down drains: Serve takes the replica out of every router at once (the
kvserve router forgets its prefix index entries and in-flight counts, ``retain``),
lets its in-flight requests finish for up to ``graceful_shutdown_timeout_s`` (the
server's ``--graceful-shutdown-timeout``), then calls the replica's ``__del__``,
which stops its engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvserve.cluster.scaling_policy import DEFAULT_TARGET_KV_USAGE, EnginePressurePolicy

RAY_UPSCALE_DELAY_S = 30.0
RAY_DOWNSCALE_DELAY_S = 600.0
RAY_LOOK_BACK_S = 30.0
RAY_METRICS_INTERVAL_S = 10.0
POLICY_PATH = "kvserve.cluster.scaling_policy:EnginePressurePolicy"


@dataclass(frozen=True)
class Autoscaling:
    """The autoscaled size of the engine deployment (module docstring).
    ``initial_replicas`` None starts at ``min_replicas``. ValueError (naming the flag
    and the fix) for a bad combination."""

    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float
    initial_replicas: int | None = None
    upscale_delay_s: float = RAY_UPSCALE_DELAY_S
    downscale_delay_s: float = RAY_DOWNSCALE_DELAY_S
    look_back_s: float = RAY_LOOK_BACK_S
    max_num_seqs: int = 1  # the engine's: the policy's waiting term
    target_kv_usage: float = DEFAULT_TARGET_KV_USAGE

    def __post_init__(self) -> None:
        lo, hi, n = self.min_replicas, self.max_replicas, self.initial_replicas
        if not _is_int(lo) or lo < 1:
            raise ValueError(
                f"invalid --min-replicas {lo!r}: use 1 or more (Serve keeps at least this "
                "many engine replicas)"
            )
        if not _is_int(hi) or hi < 2:
            raise ValueError(
                f"invalid --max-replicas {hi!r}: use 2 or more (for one engine, leave the "
                "replica flags out)"
            )
        if lo > hi:
            raise ValueError(
                f"--min-replicas {lo} is more than --max-replicas {hi}: use "
                f"--min-replicas <= --max-replicas (e.g. --min-replicas {hi} --max-replicas {lo})"
            )
        if n is not None and (not _is_int(n) or not lo <= n <= hi):
            raise ValueError(
                f"--replicas {n!r} conflicts with --min-replicas {lo} --max-replicas {hi}: "
                f"with autoscaling --replicas is the starting size and must lie in [{lo}, {hi}] "
                "(or leave it out to start at --min-replicas)"
            )
        t = self.target_ongoing_requests
        if not _is_number(t) or not t > 0:
            raise ValueError(
                f"invalid --target-ongoing-requests {t!r}: use a number > 0 (requests per "
                "replica, running plus waiting, that Serve scales to keep)"
            )
        for flag, value in (
            ("--upscale-delay", self.upscale_delay_s),
            ("--downscale-delay", self.downscale_delay_s),
        ):
            if not _is_number(value) or not value >= 0:
                raise ValueError(f"invalid {flag} {value!r}: use a number of seconds >= 0")
        w = self.look_back_s
        if not _is_number(w) or not w > 0:
            raise ValueError(
                f"invalid --autoscale-look-back {w!r}: use a number of seconds > 0 (the "
                "window Serve averages the load over)"
            )
        EnginePressurePolicy(self.max_num_seqs, self.target_kv_usage)  # its checks

    @property
    def start_replicas(self) -> int:
        return self.min_replicas if self.initial_replicas is None else self.initial_replicas

    @property
    def metrics_interval_s(self) -> float:
        """How often the load is reported: three reports per look-back window, at most
        Ray's default 10 s (so the default window keeps Ray's defaults)."""
        return min(RAY_METRICS_INTERVAL_S, float(self.look_back_s) / 3)

    def to_ray(self) -> dict[str, Any]:
        """The deployment's ``autoscaling_config`` (Ray Serve 2.60's field names)."""
        return {
            "min_replicas": self.min_replicas,
            "initial_replicas": self.start_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": float(self.target_ongoing_requests),
            "upscale_delay_s": float(self.upscale_delay_s),
            "downscale_delay_s": float(self.downscale_delay_s),
            "look_back_period_s": float(self.look_back_s),
            "metrics_interval_s": self.metrics_interval_s,
            "policy": {
                "policy_function": POLICY_PATH,
                "policy_kwargs": {
                    "max_num_seqs": self.max_num_seqs,
                    "target_kv_usage": float(self.target_kv_usage),
                },
            },
        }


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return _is_int(x) or (isinstance(x, float) and math.isfinite(x))


def autoscaling_from_flags(
    *,
    replicas: int | None,
    min_replicas: int | None,
    max_replicas: int | None,
    target_ongoing_requests: float | None,
    upscale_delay_s: float | None,
    downscale_delay_s: float | None,
    max_num_seqs: int,
    look_back_s: float | None = None,
    target_kv_usage: float | None = None,
    disaggregated: bool = False,
) -> Autoscaling | None:
    """The ``serve`` flags as an :class:`Autoscaling`, or None for a fixed size (no
    autoscaling flag given). ``max_num_seqs``: the engine's, the default target.
    Caller rule: pass the parsed flag values as they are (None = not given).
    ValueError (naming the flags and the fix) for a bad combination."""
    tuning = {
        "--target-ongoing-requests": target_ongoing_requests,
        "--upscale-delay": upscale_delay_s,
        "--downscale-delay": downscale_delay_s,
        "--autoscale-look-back": look_back_s,
        "--target-kv-usage": target_kv_usage,
    }
    if min_replicas is None and max_replicas is None:
        given = [flag for flag, value in tuning.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} only tune autoscaling: add --min-replicas M "
                "--max-replicas X (or drop them for a fixed --replicas N)"
            )
        return None
    if disaggregated:
        raise ValueError(
            "--min-replicas/--max-replicas cannot be combined with --prefill-replicas/"
            "--decode-replicas: autoscaling covers identical engine replicas only; drop one"
        )
    if min_replicas is None or max_replicas is None:
        missing = "--max-replicas" if max_replicas is None else "--min-replicas"
        raise ValueError(
            f"autoscaling needs both --min-replicas and --max-replicas: add {missing} "
            "(or use --replicas N for a fixed size)"
        )
    return Autoscaling(
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        target_ongoing_requests=(
            max_num_seqs if target_ongoing_requests is None else target_ongoing_requests
        ),
        initial_replicas=replicas,
        upscale_delay_s=RAY_UPSCALE_DELAY_S if upscale_delay_s is None else upscale_delay_s,
        downscale_delay_s=(
            RAY_DOWNSCALE_DELAY_S if downscale_delay_s is None else downscale_delay_s
        ),
        look_back_s=RAY_LOOK_BACK_S if look_back_s is None else look_back_s,
        max_num_seqs=max_num_seqs,
        target_kv_usage=DEFAULT_TARGET_KV_USAGE if target_kv_usage is None else target_kv_usage,
    )
