"""The scheduler's side of a KV connector (:mod:`kvserve.kv_transfer`): requests
parked while part of their prompt KV is loaded from outside, and finished requests
whose blocks the connector is still sending.

    waiting --(connector matches external tokens)--> parked --(load ends)--> front of waiting
    running --(finishes, connector sends its blocks)--> sending --(sent)--> blocks freed

:class:`RemoteKV` holds both maps; the scheduler asks it for the external tokens of
a request it admits (:meth:`RemoteKV.num_external_tokens`), parks the request
(:meth:`RemoteKV.park`) or tells the connector about its blocks
(:meth:`RemoteKV.allocated`), offers every finished request's blocks
(:meth:`RemoteKV.keeps_blocks`) and applies :meth:`RemoteKV.poll` each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_transfer.connector import KVConnectorScheduler
from kvserve.request import Request, RequestStatus


@dataclass
class Polled:
    """What :meth:`RemoteKV.poll` found: ``resumed`` requests (their load ended; put
    them back at the front of ``waiting``, in order) and ``failed`` ones (the load
    failed fatally: end each with its error and release it)."""

    resumed: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)


class RemoteKV:
    """Parked and sending requests of one scheduler (see the module docstring).

    ``waiting`` and ``sending`` map request ids to requests; the scheduler exposes
    them as ``waiting_for_remote`` and ``sending``. Without a connector both stay
    empty and every method is a no-op."""

    def __init__(self, connector: KVConnectorScheduler | None, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        self.waiting: dict[str, Request] = {}
        self.sending: dict[str, Request] = {}  # finished; blocks freed when sent

    def num_external_tokens(self, request: Request, num_hit: int) -> int:
        """Tokens after the ``num_hit`` prefix-cache hit the connector will load,
        at most all but the last (which the request computes itself); 0 without one."""
        if self.connector is None:
            return 0
        self.kv.block_hashes(request)  # the connector checks/sends them
        num_external = self.connector.get_num_new_matched_tokens(request, num_hit)
        return max(0, min(num_external, request.num_tokens - 1 - num_hit))

    def park(self, request: Request, num_external: int) -> None:
        """``request`` holds blocks for its ``num_external`` tokens: wait for them."""
        assert self.connector is not None
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting[request.req_id] = request
        self.connector.update_state_after_alloc(
            request, self.kv.get_block_ids(request.req_id), num_external
        )

    def allocated(self, request: Request, block_ids: list[int]) -> None:
        """``request`` was admitted to compute its prompt here (nothing external)."""
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, block_ids, 0)

    def keeps_blocks(self, request: Request) -> bool:
        """Offer a finished request's blocks to the connector: True when it still
        sends them (the request waits in ``sending``; :meth:`poll` frees them)."""
        if self.connector is None or not self.connector.request_finished(
            request, self.kv.get_block_ids(request.req_id)
        ):
            return False
        self.sending[request.req_id] = request
        return True

    def poll(self, enable_prefix_caching: bool) -> Polled:
        """Free the blocks the connector no longer sends; take the parked requests
        whose load ended. A resumed request counts the tokens that arrived as
        computed (registered in the prefix cache when ``enable_prefix_caching``)."""
        polled = Polled()
        connector = self.connector
        if connector is None:
            return polled
        for req_id in connector.get_finished_sending():
            request = self.sending.pop(req_id, None)
            if request is not None:
                self.kv.free(request)
        for result in connector.get_finished_loads():
            request = self.waiting.pop(result.req_id, None)
            if request is None:
                continue
            if result.error is not None and result.fatal:
                polled.failed.append((request, result.error))
                continue
            request.num_computed_tokens += result.num_tokens_ok
            request.num_external_tokens = result.num_tokens_ok
            if enable_prefix_caching:
                self.kv.cache_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.WAITING
            polled.resumed.append(request)
        return polled
