"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_helpers import ServerProcess, serve_process

# ---------------------------------------------------------------------- server tests
SERVER_API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def kvserve_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real ``kvserve serve`` subprocess on the default model for the session.

    The API key comes from ``KVSERVE_API_KEY`` (so every /v1 call sends it);
    max_model_len 2048 keeps the too-long-prompt tests cheap.
    """
    args = ["--num-kv-blocks", "512", "--max-model-len", "2048", "--no-access-log"]
    with serve_process(args, tmp_path_factory.mktemp("serve"), api_key=SERVER_API_KEY) as server:
        yield server
