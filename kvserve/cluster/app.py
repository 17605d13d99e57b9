"""The scale-out Serve application: ingress -> engine replicas, plus the metrics hub.

    HTTP :port ── Serve proxy ── KVServeIngress × K (tokenize + hash, OpenAI routes)
                                      │ DeploymentHandle + KVServeRequestRouter
                                      ▼
                        EngineReplica × N (one engine process each, T threads;
                                      │  N fixed, or autoscaled: autoscaling.py)
                                      │ metrics push
                                      ▼
                        MetricsHub (1) ◀── /metrics reads it at scrape time

Prefill/decode pools (``prefill_replicas``/``decode_replicas``): the ingress routes
to DecodeReplica × D (an ``EngineReplica`` with a decode connector, same router);
each decode replica prefills on PrefillReplica × P over the KV transfer, the
addresses and reports read from the metrics hub (``pool_peers``)::

    KVServeIngress ──▶ DecodeReplica × D ══ KV chunks (ZeroMQ) ══ PrefillReplica × P
                              └── prefill_peers() ──▶ MetricsHub ◀── push(peer) ──┘

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
from kvserve.cluster.prefill_replica import PrefillReplica
from kvserve.cluster.replica import EngineReplica
from kvserve.cluster.router import KVServeRequestRouter
from kvserve.kv_transfer.config import KVTransferConfig

APP_NAME = "kvserve"
MAX_INGRESS_REPLICAS = 64


@dataclass(frozen=True)
class ClusterOptions:
    """``engine_options``: flat engine options (``kvserve.engine.args``) for every
    replica. ``routing``: the router's settings. ``max_ongoing_requests``: per
    replica, past which Ray offers the request to the next-ranked replica.

    The size: ``num_replicas`` (fixed, >= 2) or ``autoscaling`` (then
    ``num_replicas`` must be None: ``Autoscaling.initial_replicas`` is the start), or
    prefill/decode pools: ``prefill_replicas`` and ``decode_replicas`` (both >= 1,
    ``num_replicas`` and ``autoscaling`` None), with ``kv_transfer`` the pools'
    ``--kv-*`` options (roles and addresses are set per replica).
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
    prefill_replicas: int | None = None
    decode_replicas: int | None = None
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    def __post_init__(self) -> None:
        scaling = self.autoscaling
        if self.is_pools:
            self._check_pools()
        elif scaling is None and (not isinstance(self.num_replicas, int) or self.num_replicas < 2):
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
        elif m is not None and (not isinstance(m, int) or not 1 <= m <= self.total_replicas):
            what = "--prefill-replicas + --decode-replicas" if self.is_pools else "--replicas"
            raise ValueError(
                f"invalid --min-healthy-replicas {m!r}: use 1 to {what} "
                f"({self.total_replicas}), or leave it out for all of them"
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
    def is_pools(self) -> bool:
        """Prefill/decode pools (either pool size given)."""
        return self.prefill_replicas is not None or self.decode_replicas is not None

    def _check_pools(self) -> None:
        for flag, n in (
            ("--prefill-replicas", self.prefill_replicas),
            ("--decode-replicas", self.decode_replicas),
        ):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(
                    f"invalid {flag} {n!r}: prefill/decode pools need both "
                    "--prefill-replicas and --decode-replicas, each >= 1 "
                    "(for example: --prefill-replicas 1 --decode-replicas 2)"
                )
        if self.num_replicas is not None or self.autoscaling is not None:
            raise ValueError(
                "--replicas (or --min/--max-replicas) cannot be combined with "
                "--prefill-replicas/--decode-replicas: the pools are the deployment's size"
            )
        self.kv_transfer.validate()
        kv = self.kv_transfer
        if kv.kv_role != "both" or kv.kv_address or kv.kv_prefill_peers:
            raise ValueError(
                "--kv-role, --kv-address and --kv-prefill-peers are set per replica in "
                "prefill/decode pools (the replicas find each other through Ray): drop them"
            )

    @property
    def total_replicas(self) -> int:
        """Engine replicas of a fixed size: ``num_replicas``, or both pools."""
        if self.is_pools:
            return (self.prefill_replicas or 0) + (self.decode_replicas or 0)
        return self.fixed_replicas

    @property
    def fixed_replicas(self) -> int:
        """The fixed size (0 when autoscaled)."""
        return self.num_replicas if self.autoscaling is None and self.num_replicas else 0

    @property
    def most_replicas(self) -> int:
        """Engine replicas that may run at once (``--max-replicas`` when autoscaled)."""
        if self.autoscaling is not None:
            return self.autoscaling.max_replicas
        return self.total_replicas

    @property
    def start_replicas(self) -> int:
        """Replicas the deployment starts with."""
        if self.autoscaling is not None:
            return self.autoscaling.start_replicas
        return self.total_replicas

    @property
    def healthy_floor(self) -> int:
        """``/health`` is 200 with at least this many replicas alive: the given
        ``min_healthy_replicas``, else every fixed replica or ``--min-replicas``."""
        if self.min_healthy_replicas is not None:
            return self.min_healthy_replicas
        if self.autoscaling is not None:
            return self.autoscaling.min_replicas
        return self.total_replicas

    def scaling_options(self) -> dict[str, Any]:
        """The engine deployment's size options for ``serve.deployment``."""
        if self.autoscaling is not None:
            return {"autoscaling_config": self.autoscaling.to_ray()}
        if self.is_pools:
            return {"num_replicas": self.decode_replicas}
        return {"num_replicas": self.fixed_replicas}


def build_application(opts: ClusterOptions) -> Any:
    deployment: Any = serve.deployment  # ray's stubs type only its decorator form
    # The hub and the ingresses are removed only when the application stops (their
    # counts are fixed): each replica's first shutdown wait is 0.2 s, not Serve's 2 s,
    # so a stop does not sit 4 s on them. Engine replicas keep Serve's wait: one that
    # autoscaling removes may still get requests routed just before.
    quick_stop = {"graceful_shutdown_wait_loop_s": 0.2, "graceful_shutdown_timeout_s": 5.0}
    hub = deployment(
        MetricsHub,
        name="MetricsHub",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        **quick_stop,
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
    engine_args: tuple[Any, ...] = (opts.engine_options, opts.threads_per_replica, hub)
    engine_kwargs: dict[str, Any] = {"metrics_push_s": opts.metrics_push_s}
    prefill: Any = None
    if opts.is_pools:
        prefill = deployment(
            PrefillReplica,
            name="PrefillReplica",
            num_replicas=opts.prefill_replicas,
            health_check_period_s=opts.health_check_period_s,
            health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=opts.graceful_shutdown_timeout_s,
            ray_actor_options={"num_cpus": opts.threads_per_replica},
        ).bind(
            opts.engine_options,
            opts.threads_per_replica,
            opts.kv_transfer,
            hub,
            opts.metrics_push_s,
        )
        engine_kwargs.update(kv=opts.kv_transfer, routing=routing)
    engine = deployment(
        EngineReplica,
        name="DecodeReplica" if opts.is_pools else "EngineReplica",
        **opts.scaling_options(),
        max_ongoing_requests=opts.max_ongoing_requests,
        health_check_period_s=opts.health_check_period_s,
        health_check_timeout_s=30.0,
        # a replica scaled away drains: Serve waits this long for its requests
        graceful_shutdown_timeout_s=opts.graceful_shutdown_timeout_s,
        ray_actor_options={"num_cpus": opts.threads_per_replica},
        request_router_config=RequestRouterConfig(**router_config),
    ).bind(*engine_args, **engine_kwargs)
    ingress = deployment(
        KVServeIngress,
        name="KVServeIngress",
        num_replicas=opts.ingress_replicas,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_wait_loop_s=quick_stop["graceful_shutdown_wait_loop_s"],
    ).bind(
        engine,
        hub,
        opts.engine_options.get("model"),
        opts.served_model_name,
        opts.api_key,
        opts.max_queue_len,
        opts.healthy_floor,
        opts.http_options,
        prefill,  # bound here so serve.run deploys the prefill pool (reached over KV transfer)
    )
    return ingress
