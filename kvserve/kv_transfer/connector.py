"""The KV connector protocol: the seam for disaggregated serving (prefill and decode
on different workers), with the chunk as the unit, shaped after vLLM V1's connectors.

Two halves, both called on the engine thread only:

- :class:`KVConnectorScheduler` (the scheduler calls it) decides how many prompt
  tokens come from outside, learns which blocks were allocated for them, builds the
  per-step :class:`KVConnectorMetadata` for the worker, reports loads that finished
  or failed, and decides what happens to a finished request's blocks.
- :class:`KVConnectorWorker` (the model runner calls it) loads received blocks into
  the paged cache before a step and saves the blocks a step completed right after it.

Neither the scheduler nor the runner knows about transports; implementations live
next to this file (``decode_connector`` / ``prefill_connector`` over a
``transport``). A request that loads remotely looks like this on the decode side::

    prompt:   [ local prefix hit | external (remote prefill, full blocks) | local <= B ]
               ^ 0               ^ num_computed_tokens at admission        ^ P_full   ^ P
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.kv_transfer.stats import TransferStats
from kvserve.request import Request


@dataclass
class BlockLoad:
    """Received KV for some of a request's blocks: ``data`` is
    ``[L, 2, Hk, len(block_ids), B, D]`` to be written into ``block_ids``."""

    req_id: str
    block_ids: list[int]
    data: Any  # torch.Tensor (kept untyped: the scheduler side never imports torch)


@dataclass
class BlockSave:
    """Blocks a step completes for a request that pushes its KV: the block ids in
    this engine's cache, their positions in the request and their hashes (hex)."""

    req_id: str
    block_ids: list[int]
    block_indices: list[int]
    block_hashes: list[str]


@dataclass
class KVConnectorMetadata:
    """What the worker side does around one step (plain data)."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)
    step_end_hook: bool = False  # the worker calls ``step_finished`` after saving

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass
class LoadResult:
    """A remote load that ended. ``num_tokens_ok``: tokens after the local prefix hit
    whose KV arrived, was checked and is loaded (a whole-block count; the request
    resumes from there). ``error`` is None on success; with ``fatal`` the request
    must end with that error (policy "fail") instead of computing the rest."""

    req_id: str
    num_tokens_ok: int
    error: str | None = None
    fatal: bool = False


class KVConnectorScheduler(Protocol):
    """Scheduler side. Rules the scheduler keeps:

    - ``get_num_new_matched_tokens(request, num_computed_tokens)`` is asked once per
      admission; it returns how many tokens after the local prefix hit the outside
      source will supply (>= 0, never the request's last token). When > 0 the
      scheduler allocates blocks for them, calls ``update_state_after_alloc`` with
      the request's block ids, parks the request (not scheduled) and waits for a
      :class:`LoadResult` from ``get_finished_loads``.
    - ``build_connector_meta(scheduler_output)`` is called once per step, after the
      step is decided; the worker side must see that metadata in the same step.
    - ``request_finished(request, block_ids)`` is called right before a request's
      blocks would be freed (finish, abort, preemption). Returning True means "keep
      the blocks": the scheduler frees them once the id appears in
      ``get_finished_sending``. A preempted or aborted request never delays.
    """

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int: ...

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata | None: ...

    def get_finished_loads(self) -> list[LoadResult]: ...

    def get_finished_sending(self) -> set[str]: ...

    def request_finished(self, request: Request, block_ids: list[int]) -> bool: ...


class KVConnectorWorker(Protocol):
    """Worker side. Rules the runner keeps: ``register_kv_cache`` once, before any
    step; ``load_kv`` before the forward pass of every step whose metadata is not
    None (also when nothing else is scheduled); ``save_kv`` right after that
    forward pass (the blocks it names hold their final KV by then)."""

    def register_kv_cache(self, kv_cache: Any) -> None: ...

    def load_kv(self, metadata: KVConnectorMetadata) -> None: ...

    def save_kv(self, metadata: KVConnectorMetadata) -> None: ...


class KVConnector(KVConnectorScheduler, KVConnectorWorker, Protocol):
    """A whole connector, as :class:`~kvserve.engine.engine_core.EngineCore` takes it:
    both halves plus what the engine front (``AsyncEngine``) calls. Rules: ``is_ready``
    may be read from any thread (``/health``); ``set_wakeup`` is called once, before
    the engine thread starts, with a callable any thread may call when a transfer
    needs the engine; ``close`` once, after the engine thread stopped; ``stats`` is
    thread-safe (its ``snapshot()`` feeds the metrics)."""

    @property
    def is_ready(self) -> bool: ...

    @property
    def stats(self) -> TransferStats: ...

    def set_wakeup(self, wakeup: Callable[[], None]) -> None: ...

    def close(self) -> None: ...
