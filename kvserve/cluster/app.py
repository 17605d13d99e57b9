"""The scale-out Serve application: ingress -> engine replicas, plus the metrics hub.

    HTTP :port ── Serve proxy ── KVServeIngress (1, tokenize + hash, OpenAI routes)
                                      │ DeploymentHandle + KVServeRequestRouter
                                      ▼
                        EngineReplica × N (one engine process each, T threads)
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

from kvserve.cluster.ingress import KVServeIngress
from kvserve.cluster.metrics_hub import MetricsHub
from kvserve.cluster.policy import RoutingConfig
from kvserve.cluster.replica import EngineReplica
from kvserve.cluster.router import KVServeRequestRouter

APP_NAME = "kvserve"


@dataclass(frozen=True)
class ClusterOptions:
    """``engine_options``: flat engine options (``kvserve.engine.args``) for every
    replica. ``routing``: the router's settings. ``max_ongoing_requests``: per
    replica, past which Ray offers the request to the next-ranked replica."""

    num_replicas: int
    threads_per_replica: int
    engine_options: dict[str, Any] = field(default_factory=dict)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue_len: int | None = None
    min_healthy_replicas: int | None = None  # None: all of them
    # build_app's chat and HTTP-guard options (chat_template, max_request_body_bytes...)
    http_options: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 256
    stats_period_s: float = 0.5
    health_check_period_s: float = 1.0
    metrics_push_s: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.num_replicas, int) or self.num_replicas < 2:
            raise ValueError(
                f"invalid --replicas {self.num_replicas!r}: scale-out needs at least 2 replicas "
                "(for one engine, leave --replicas out)"
            )
        m = self.min_healthy_replicas
        if m is not None and (not isinstance(m, int) or not 1 <= m <= self.num_replicas):
            raise ValueError(
                f"invalid --min-healthy-replicas {m!r}: use 1 to --replicas "
                f"({self.num_replicas}), or leave it out for all of them"
            )
        if not isinstance(self.threads_per_replica, int) or self.threads_per_replica < 1:
            raise ValueError(
                f"invalid --threads-per-replica {self.threads_per_replica!r}: must be >= 1"
            )


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
        },
        "request_routing_stats_period_s": opts.stats_period_s,
        "request_routing_stats_timeout_s": 10.0,
    }
    engine = deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=opts.num_replicas,
        max_ongoing_requests=opts.max_ongoing_requests,
        health_check_period_s=opts.health_check_period_s,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        ray_actor_options={"num_cpus": opts.threads_per_replica},
        request_router_config=RequestRouterConfig(**router_config),
    ).bind(opts.engine_options, opts.threads_per_replica, hub, opts.metrics_push_s)
    ingress = deployment(
        KVServeIngress,
        name="KVServeIngress",
        num_replicas=1,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0},
    ).bind(
        engine,
        hub,
        opts.engine_options.get("model"),
        opts.served_model_name,
        opts.api_key,
        opts.max_queue_len,
        opts.min_healthy_replicas or opts.num_replicas,
        opts.http_options,
    )
    return ingress
