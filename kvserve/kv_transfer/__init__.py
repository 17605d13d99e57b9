"""KV transfer between engines (disaggregated serving): the connector protocol."""

from __future__ import annotations

from kvserve.kv_transfer.connector import KVConnector

__all__ = ["KVConnector"]
