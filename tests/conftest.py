"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.server_helpers import ServerProcess, serve_process

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


# ---------------------------------------------------------------------- model tests
# (kvserve and transformers are imported inside the fixtures, so collecting the other
# tests stays cheap)


@pytest.fixture(scope="session")
def default_model_dir():
    """HF folder of the default model (converted from its GGUF once, then cached)."""
    from kvserve.model.loader import DEFAULT_MODEL_NAME, resolve_model

    return resolve_model(DEFAULT_MODEL_NAME)


@pytest.fixture(scope="session")
def loaded_model(default_model_dir):
    """kvserve's default model in fp32 on CPU, loaded once per session."""
    from kvserve.model.loader import DEFAULT_MODEL_NAME, load_model

    # parity tests pin float32 dequantized weights
    return load_model(DEFAULT_MODEL_NAME, dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    """HF transformers' model on the same converted weights (fp32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def single_thread_torch():
    """Run a module's tests with one torch thread, then restore the setting.

    On a machine shared with other busy processes every multi-threaded op can wait a
    whole scheduler time slice for its second thread; one thread keeps the model
    tests fast there. Results do not depend on the thread count beyond rounding.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
