"""Build the runner's :class:`~kvserve.spec_decode.decoder.SpecDecoder` from a config."""

from __future__ import annotations

from typing import Any

from kvserve.spec_decode.decoder import SpecDecoder
from kvserve.speculative_config import SpeculativeConfig


def build_spec_decoder(config: SpeculativeConfig, loaded: Any, cache_config: Any) -> SpecDecoder:
    """The n-gram proposer needs nothing; a draft model is loaded next to the target
    (same tokenizer required) with its own paged KV cache."""
    if config.method == "ngram":
        return SpecDecoder(config)
    from kvserve.spec_decode.draft_model import DraftModelProposer

    return SpecDecoder(config, DraftModelProposer.load(config, loaded, cache_config))
