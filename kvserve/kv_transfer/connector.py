"""The KV connector protocol: the seam for disaggregated serving (prefill and decode
on different workers). No implementation ships yet; the scheduler only calls this
protocol and never knows about transports."""

from __future__ import annotations

from typing import Protocol

from kvserve.request import Request


class KVConnector(Protocol):
    """Seam for disaggregated serving (GUIDE "Seams"); no implementation ships yet.

    Scheduler side only. A connector lets an outside source (a prefill worker)
    supply prompt KV and learns when a request's blocks are about to be freed. The
    model-runner side (load KV before the forward pass, save a layer's KV after it)
    belongs to the runner and is not part of this protocol.

    - ``get_num_new_matched_tokens(request, num_computed_tokens)``: how many tokens
      after the local prefix hit the outside source can supply (>= 0). The scheduler
      allocates blocks for them without spending token budget and counts them as
      computed; it never asks for the request's last token.
    - ``update_state_after_alloc(request, block_ids, num_external_tokens)``: the
      blocks are allocated; the connector must have their KV loaded before the
      request's first forward pass.
    - ``request_finished(request, block_ids)``: called right before the request's
      blocks are freed (finish, abort or preemption). A connector that still needs
      the KV must copy it out during this call.
    """

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int: ...

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None: ...

    def request_finished(self, request: Request, block_ids: list[int]) -> None: ...
