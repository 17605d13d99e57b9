"""Sampling: one token per row of logits (:mod:`.sampler`), the logits rules it applies
(:mod:`.logits_rules`) and what it knows of one request (:mod:`.sampling_state`).

Below both the model runner and speculative decoding, which draw from the same
distributions; it imports neither.
"""
