"""What the sampler knows of one request: :class:`SamplingRequestState` (one logits
row). Below both the sampler and its logits rules, which read it."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.request import SamplingParams


@dataclass
class SamplingRequestState:
    """What the sampler needs to know about one request (one logits row).

    The caller (model runner) keeps ``output_token_ids`` equal to the tokens the
    request has generated so far, appending each sampled id after the step; the
    seeded draw uses ``len(output_token_ids)`` as the step number, so it must count
    every generated token, also those generated before a preemption.
    ``eos_token_id`` (optional) is suppressed together with ``params.stop_token_ids``
    while fewer than ``params.min_tokens`` tokens have been generated, unless
    ``params.ignore_eos``.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None = None
