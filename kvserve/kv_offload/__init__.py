"""A KV tier beyond RAM: full blocks of the prefix cache on disk, by block hash.

``store`` (files, LRU index, writer thread; no torch) and ``tier`` (the paged cache's
blocks to and from the store). The KV cache manager reaches it only through the
:class:`~kvserve.kv_cache.tier.KVTier` protocol; docs/kv-offload.md.
"""
