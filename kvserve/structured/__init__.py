"""Structured outputs: what a request asks for (:mod:`.params`), its grammar compiled
once and cached (:mod:`.compiler`), and the per-request token masks the model runner
hands to the sampler (:mod:`.matcher`)."""
