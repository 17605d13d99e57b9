"""Keep a local cluster's Serve replicas off the network.

Ray Serve (2.60) starts, in every replica process, an inter-deployment gRPC
(HTTP/2) server bound to ``[::]:0`` — every interface — whatever the node address;
there is no option for it. A local cluster (``kvserve serve --replicas N`` without
``--ray-address``) is documented as loopback-only, so each kvserve deployment calls
:func:`bind_serve_grpc_to_loopback` in its constructor, which runs in the replica
process before Serve starts that server (``Replica._on_initialized``): the server then
binds ``127.0.0.1`` (the address the node advertises, so handles still reach it).
Only when the launcher marked the cluster local (``LOCAL_CLUSTER_ENV``); a joined
multi-machine cluster keeps Ray's binding. Check with ``ss -ltnp``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("kvserve.cluster")

LOCAL_CLUSTER_ENV = "KVSERVE_LOCAL_CLUSTER"


def bind_serve_grpc_to_loopback() -> bool:
    """Patch this replica process so Serve's gRPC server binds 127.0.0.1; True when
    patched (idempotent). A no-op outside a local cluster or when Ray changed."""
    if os.environ.get(LOCAL_CLUSTER_ENV) != "1":
        return False
    try:
        import ray.serve._private.replica as replica_module
    except ImportError:
        return False
    original: Any = getattr(replica_module, "add_port_to_grpc_server", None)
    if original is None:
        logger.warning("Ray Serve changed: its replica gRPC server keeps Ray's binding")
        return False
    if getattr(original, "_kvserve_loopback", False):
        return True

    def loopback(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.removeprefix("[::]:")
        return original(server, address)

    loopback._kvserve_loopback = True  # type: ignore[attr-defined]
    replica_module.add_port_to_grpc_server = loopback
    return True
