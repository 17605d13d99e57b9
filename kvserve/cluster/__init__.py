"""Scale-out on Ray Serve (``kvserve serve --replicas N``): the Serve app, the
prefix-cache-aware request router and its index. The only package that imports
``ray``; nothing outside it imports this package except ``serve_cmd`` under
``--replicas``. ``policy``, ``prefix_index``, ``protocol`` and ``cluster_metrics``
are plain Python (no ray), so the routing logic is testable without a cluster.
See docs/scale-out.md."""

from __future__ import annotations
