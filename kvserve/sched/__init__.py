"""Schedulers: who runs each step and how many tokens each computes.

Two policies behind one interface (:class:`Scheduler`), chosen by
``SchedulerConfig.scheduler_policy``: ``"mixed"`` (:class:`MixedScheduler`, default)
and ``"separated"`` (:class:`SeparatedScheduler`). Neither imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvserve.buckets import (
    default_num_batched_tokens_buckets,
    default_num_seqs_buckets,
    get_bucket,
    validate_buckets,
)
from kvserve.config import SchedulerConfig
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_transfer.connector import KVConnector, KVConnectorScheduler
from kvserve.sched.base import Scheduler, SchedulerState
from kvserve.sched.mixed import MixedScheduler
from kvserve.sched.separated import SeparatedScheduler
from kvserve.sched.step_builder import StepBuilder, is_decode

POLICIES: dict[str, type[Scheduler]] = {
    "mixed": MixedScheduler,
    "separated": SeparatedScheduler,
}


def make_scheduler(
    config: SchedulerConfig,
    kv_cache_manager: KVCacheManager,
    *,
    kv_connector: KVConnectorScheduler | None = None,
    clock: Callable[[], float] = time.time,
) -> Scheduler:
    """Build the scheduler ``config.scheduler_policy`` names. Raises ValueError on a
    bad config (the message names the value, the rule and a valid example)."""
    config = config.resolved()  # validates (once per configuration)
    cls = POLICIES[config.scheduler_policy]
    return cls(config, kv_cache_manager, kv_connector=kv_connector, clock=clock)


def decode_batch_buckets(config: SchedulerConfig) -> tuple[int, ...] | None:
    """The batch sizes ``config.scheduler_policy`` pads decode steps to (None: it never
    pads); the policy class owns the answer (:meth:`Scheduler.decode_batch_buckets`)."""
    return POLICIES[config.scheduler_policy].decode_batch_buckets(config)


__all__ = [
    "POLICIES",
    "KVConnector",
    "MixedScheduler",
    "Scheduler",
    "SchedulerState",
    "SeparatedScheduler",
    "StepBuilder",
    "decode_batch_buckets",
    "default_num_batched_tokens_buckets",
    "default_num_seqs_buckets",
    "get_bucket",
    "is_decode",
    "make_scheduler",
    "validate_buckets",
]
