"""KVServeRequestRouter: the Ray Serve custom request router of the engine deployment.

Ray Serve runs one instance per deployment handle (here: in the ingress process) and
calls ``choose_replicas`` for every request; this class only translates between Ray's
types and :class:`~kvserve.cluster.policy.RoutingLogic`, which decides:

- the candidates' latest :class:`ReplicaReport` (their ``routing_stats``) correct the
  prefix index and the loads;
- the request's block keys come from its :class:`RoutedRequest` argument (calls
  without one, such as ``info``, are routed as least-loaded and not recorded);
- the ranking is returned as one rank per replica, best first, so Ray sends to the
  best unless its queue is full (``max_ongoing_requests``), then the next;
- the decision is written on the ``RoutedRequest`` (``decision``) for the ingress's
  metrics; ``on_request_completed`` ends the request in the logic.

Dead replicas leave at once: the ingress's replica watch (``RemoteEngine``, every
0.5 s, from the metrics hub's liveness pings) calls
:func:`~kvserve.cluster.routing_state.exclude_replicas` with the
replicas that stopped answering, and ``choose_replicas`` leaves them out, long before
Ray's controller drops them from the candidates (or a call to them fails). If every
candidate is excluded the full list is used (the watch may be wrong; Ray's own
failure handling then decides). The exclusion is per process (the router and the
watch both run in the ingress) and lives in ``routing_state``: Ray pickles this
module by value, so its own globals would be copies.

Configured through ``RequestRouterConfig.request_router_kwargs``: the fields of
:class:`~kvserve.cluster.policy.RoutingConfig`.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from kvserve.cluster import routing_state
from kvserve.cluster.policy import ReplicaReport, RoutingConfig, RoutingLogic
from kvserve.cluster.protocol import RoutedRequest


def _routed_request(pending: PendingRequest | None) -> RoutedRequest | None:
    if pending is None:
        return None
    for arg in [*pending.args, *pending.kwargs.values()]:
        if isinstance(arg, RoutedRequest):
            return arg
    return None


class KVServeRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self.logic = RoutingLogic(RoutingConfig(**kwargs))
        self._control = RoutingLogic(RoutingConfig(policy="least-loaded"))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        excluded = routing_state.excluded_replicas()
        if excluded:
            alive = [r for r in candidate_replicas if r.replica_id.unique_id not in excluded]
            candidate_replicas = alive or candidate_replicas
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        for name, replica in by_name.items():
            self.logic.observe_report(name, ReplicaReport.from_stats(replica.routing_stats))
        routed = _routed_request(pending_request)
        if routed is None:
            decision = self._control.choose(list(by_name))
        else:
            assert pending_request is not None
            decision = self.logic.choose(
                list(by_name),
                routed.keys,
                request_id=pending_request.metadata.internal_request_id,
                num_blocks_needed=routed.num_blocks_needed,
                num_seqs=routed.num_seqs,
            )
            routed.decision = decision
        routing_state.count_chosen(decision.ranked[0])
        routing_state.note_known(self.logic.known_replicas())
        return [[by_name[name]] for name in decision.ranked]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.logic.request_finished(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if hasattr(self, "logic"):  # Ray may push replicas before initialize_state
            self.logic.retain([r.replica_id.unique_id for r in replicas])
            routing_state.note_known(self.logic.known_replicas())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget the replica at once (Ray saw a call to it fail with ActorDiedError)."""
        super().on_replica_actor_died(replica_id)
        if hasattr(self, "logic"):
            alive = [r.replica_id.unique_id for r in self.curr_replicas.values()]
            self.logic.retain(alive)
            routing_state.note_known(self.logic.known_replicas())
