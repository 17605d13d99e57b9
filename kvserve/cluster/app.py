"""The scale-out Serve application: ingress -> engine replicas, plus the metrics hub.

    HTTP :port ── Serve proxy ── KVServeIngress × K (tokenize + hash, OpenAI routes)
                                      │ DeploymentHandle + KVServeRequestRouter
                                      ▼
                        EngineReplica × N (one engine process each, T threads;
                                      │  N fixed, or autoscaled: autoscaling.py)
                                      │ metrics push
                                      ▼
                        MetricsHub (1) ◀── /metrics reads it at scrape time

:func:`build_application` returns the bound app for ``serve.run``; nothing starts
until then. Rules: call it in a process connected to Ray (``ray.init``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from kvserve.cluster.autoscaling import Autoscaling
from kvserve.cluster.ingress import KVServeIngress
from kvserve.cluster.metrics_hub import MetricsHub
from kvserve.cluster.policy import RoutingConfig
from kvserve.cluster.replica import EngineReplica
from kvserve.cluster.router import KVServeRequestRouter

APP_NAME = "kvserve"
MAX_INGRESS_REPLICAS = 64


@dataclass(frozen=True)
class ClusterOptions:
    """``engine_options``: flat engine options (``kvserve.engine.args``) for every
    replica. ``routing``: the router's settings. ``max_ongoing_requests``: per
    replica, past which Ray offers the request to the next-ranked replica.

    The size: ``num_replicas`` (fixed, >= 2) or ``autoscaling`` (then
    ``num_replicas`` must be None: ``Autoscaling.initial_replicas`` is the start).
    ``ingress_replicas``: copies of the HTTP ingress behind Serve's proxy (1 to
    ``MAX_INGRESS_REPLICAS``; more than one refuses a default ``--seed``).
    ``graceful_shutdown_timeout_s``: how long a replica that is scaled away (or
    replaced) lets its in-flight requests finish before Serve kills it.
    ValueError names the bad flag."""

    num_replicas: int | None
    threads_per_replica: int
    engine_options: dict[str, Any] = field(default_factory=dict)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue_len: int | None = None
    min_healthy_replicas: int | None = None  # None: all of them
    # build_app's chat and HTTP-guard options (chat_template, max_request_body_bytes...)
    http_options: dict[str, Any] = field(default_factory=dict)
    autoscaling: Autoscaling | None = None
    graceful_shutdown_timeout_s: float = 30.0
    ingress_replicas: int = 1
    max_ongoing_requests: int = 256
    stats_period_s: float = 0.5
    health_check_period_s: float = 1.0
    metrics_push_s: float = 0.5

    def __post_init__(self) -> None:
        scaling = self.autoscaling
        if scaling is None and (not isinstance(self.num_replicas, int) or self.num_replicas < 2):
            raise ValueError(
                f"invalid --replicas {self.num_replicas!r}: scale-out needs at least 2 replicas "
                "(for one engine, leave --replicas out)"
            )
        if scaling is not None and self.num_replicas is not None:
            raise ValueError(
                "num_replicas and autoscaling are exclusive: pass the starting size as "
                "Autoscaling(initial_replicas=...)"
            )
        m = self.min_healthy_replicas
        if scaling is not None:
            if m is not None and (not isinstance(m, int) or not 1 <= m <= scaling.min_replicas):
                raise ValueError(
                    f"invalid --min-healthy-replicas {m!r}: with autoscaling use 1 to "
                    f"--min-replicas ({scaling.min_replicas}), or leave it out for "
                    "--min-replicas (more would turn /health 503 after every scale-down)"
                )
            if scaling.target_ongoing_requests > self.max_ongoing_requests:
                raise ValueError(
                    f"--target-ongoing-requests {scaling.target_ongoing_requests} is more than "
                    f"a replica takes at once ({self.max_ongoing_requests}): use at most that"
                )
        elif m is not None and (not isinstance(m, int) or not 1 <= m <= self.fixed_replicas):
            raise ValueError(
                f"invalid --min-healthy-replicas {m!r}: use 1 to --replicas "
                f"({self.num_replicas}), or leave it out for all of them"
            )
        k = self.ingress_replicas
        if not isinstance(k, int) or not 1 <= k <= MAX_INGRESS_REPLICAS:
            raise ValueError(
                f"invalid --ingress-replicas {k!r}: use 1 to {MAX_INGRESS_REPLICAS} (each is "
                "one process behind Ray Serve's proxy)"
            )
        if k > 1 and self.http_options.get("default_seed") is not None:
            raise ValueError(
                "--seed cannot be combined with --ingress-replicas > 1: each ingress would "
                "seed the requests it happens to receive, so a run would not repeat; seed "
                'requests in their body ("seed") or use one ingress'
            )
        if not self.graceful_shutdown_timeout_s >= 0:
            raise ValueError(
                f"invalid --graceful-shutdown-timeout {self.graceful_shutdown_timeout_s!r}: "
                "use seconds >= 0"
            )
        if not isinstance(self.threads_per_replica, int) or self.threads_per_replica < 1:
            raise ValueError(
                f"invalid --threads-per-replica {self.threads_per_replica!r}: must be >= 1"
            )

    @property
    def fixed_replicas(self) -> int:
        """The fixed size (0 when autoscaled)."""
        return self.num_replicas if self.autoscaling is None and self.num_replicas else 0

    @property
    def start_replicas(self) -> int:
        """Replicas the deployment starts with."""
        if self.autoscaling is not None:
            return self.autoscaling.start_replicas
        return self.fixed_replicas

    @property
    def healthy_floor(self) -> int:
        """``/health`` is 200 with at least this many replicas alive: the given
        ``min_healthy_replicas``, else every fixed replica or ``--min-replicas``."""
        if self.min_healthy_replicas is not None:
            return self.min_healthy_replicas
        if self.autoscaling is not None:
            return self.autoscaling.min_replicas
        return self.fixed_replicas

    def scaling_options(self) -> dict[str, Any]:
        """The engine deployment's size options for ``serve.deployment``."""
        if self.autoscaling is not None:
            return {"autoscaling_config": self.autoscaling.to_ray()}
        return {"num_replicas": self.fixed_replicas}


def build_application(opts: ClusterOptions) -> Any:
    deployment: Any = serve.deployment  # ray's stubs type only its decorator form
    hub = deployment(
        MetricsHub, name="MetricsHub", num_replicas=1, ray_actor_options={"num_cpus": 0}
    ).bind()
    routing = opts.routing
    router_config: dict[str, Any] = {
        "request_router_class": KVServeRequestRouter,
        "request_router_kwargs": {
            "policy": routing.policy,
            "queue_weight": routing.queue_weight,
            "kv_weight": routing.kv_weight,
            "pending_ttl_s": routing.pending_ttl_s,
            "routers": opts.ingress_replicas,
        },
        "request_routing_stats_period_s": opts.stats_period_s,
        "request_routing_stats_timeout_s": 10.0,
    }
    engine = deployment(
        EngineReplica,
        name="EngineReplica",
        **opts.scaling_options(),
        max_ongoing_requests=opts.max_ongoing_requests,
        health_check_period_s=opts.health_check_period_s,
        health_check_timeout_s=30.0,
        # a replica scaled away drains: Serve waits this long for its requests
        graceful_shutdown_timeout_s=opts.graceful_shutdown_timeout_s,
        ray_actor_options={"num_cpus": opts.threads_per_replica},
        request_router_config=RequestRouterConfig(**router_config),
    ).bind(opts.engine_options, opts.threads_per_replica, hub, opts.metrics_push_s)
    ingress = deployment(
        KVServeIngress,
        name="KVServeIngress",
        num_replicas=opts.ingress_replicas,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0},
    ).bind(
        engine,
        hub,
        opts.engine_options.get("model"),
        opts.served_model_name,
        opts.api_key,
        opts.max_queue_len,
        opts.healthy_floor,
        opts.http_options,
    )
    return ingress
