"""``kvserve serve --replicas N`` (or ``--prefill-replicas P --decode-replicas D``):
start or join a Ray cluster and run the Serve app.

    local:   ray.init on this machine (every address 127.0.0.1), N replicas here (Ray
             gets max(cores, replicas x threads) CPUs: more replicas than cores share them)
    joined:  ray.init(address=--ray-address), replicas wherever the cluster has CPUs

The endpoint (Serve's HTTP proxy) listens on ``--host:--port``. ``serve.run`` returns
once every replica loaded its model, so ``GET /health`` answering 200 means ready.
SIGTERM or SIGINT deletes the app, shuts Serve down and disconnects (a local cluster
stops with it); the command returns 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

logger = logging.getLogger("kvserve.cluster")

LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def start_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Connect to ``address`` or start a local single-machine cluster on 127.0.0.1."""
    import ray

    os.environ.update(LOCAL_ENV)
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        from kvserve.cluster.loopback import LOCAL_CLUSTER_ENV

        ray.init(
            address="local",  # a new cluster even if `ray start` left one running here
            num_cpus=num_cpus or os.cpu_count() or 1,
            # Replicas bind Serve's gRPC server to 127.0.0.1 too (cluster/loopback.py).
            runtime_env={"env_vars": {LOCAL_CLUSTER_ENV: "1"}},
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level=logging.WARNING,
        )


def start_app(opts: Any, host: str, port: int) -> None:
    """Start Serve's proxy on ``host:port`` and deploy the app (blocks until ready)."""
    from ray import serve

    from kvserve.cluster.app import APP_NAME, build_application

    serve.start(http_options={"host": host, "port": port})
    serve.run(build_application(opts), name=APP_NAME, route_prefix="/")


def stop_app() -> None:
    """Delete the app (its replicas drain and stop), then stop Serve and disconnect."""
    import ray
    from ray import serve

    from kvserve.cluster.app import APP_NAME

    try:
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        ray.shutdown()


def local_cpus(opts: Any) -> int:
    """Ray CPUs of a local cluster: this machine's cores, or more when the replicas
    ask for more (each reserves ``--threads-per-replica``; they then share cores, with
    a warning, rather than wait forever for CPUs Ray does not have)."""
    cores = os.cpu_count() or 1
    needed = opts.most_replicas * opts.threads_per_replica
    if needed > cores:
        logger.warning(
            "%d replicas x %d threads on %d cores: the replicas share cores",
            opts.most_replicas,
            opts.threads_per_replica,
            cores,
        )
    return max(cores, needed)


def run_cluster(opts: Any, *, host: str, port: int, ray_address: str | None) -> int:
    """Run until SIGTERM/SIGINT. Returns the exit status."""
    stop = threading.Event()
    start_ray(ray_address, None if ray_address else local_cpus(opts))
    # After ray.init, which installs its own SIGTERM handler in the driver.
    handled = (signal.SIGINT, signal.SIGTERM)
    original = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in handled}
    try:
        start_app(opts, host, port)
        scaling = opts.autoscaling
        size = (
            f"{opts.prefill_replicas} prefill + {opts.decode_replicas} decode replicas"
            if opts.is_pools
            else f"{opts.start_replicas} replicas"
            if scaling is None
            else f"{opts.start_replicas} replicas (autoscaled {scaling.min_replicas} to "
            f"{scaling.max_replicas}, target {scaling.target_ongoing_requests:g} ongoing "
            "requests per replica)"
        )
        logger.info(
            "serving %s (%d threads each, routing %s) on http://%s:%d",
            size,
            opts.threads_per_replica,
            opts.routing.policy,
            host,
            port,
        )
        print(f"kvserve: {size} ready on http://{host}:{port}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in original.items():
            signal.signal(sig, handler)
        stop_app()
    return 0
