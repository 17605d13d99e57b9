"""An in-process kvserve server on the default model with the tool-aware SmolLM2
chat template (examples/) set as the operator's --chat-template, auto tool choice on
with the hermes parser. Shared by
the function-calling and real-client tests of this folder (one per module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.server_helpers import serve_thread
from support.tool_defs import TEMPLATE


@pytest.fixture(scope="module")
def tool_server() -> Iterator[str]:
    """Base URL of the server (no API key)."""
    from kvserve.engine.args import build_engine_config
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.engine_core import EngineCore
    from kvserve.entrypoints.chat.template import load_chat_template
    from kvserve.entrypoints.openai_server import build_app

    core = EngineCore(build_engine_config(num_kv_blocks=256, max_model_len=2048))
    # What `--chat-template examples/tool_chat_template_smollm2.jinja` does: the
    # operator's template, rendered in the sandboxed worker processes.
    app = build_app(
        AsyncEngine(core),
        tool_parser="hermes",
        enable_auto_tool_choice=True,
        default_seed=0,
        chat_template=load_chat_template(str(TEMPLATE)),
    )
    with serve_thread(app) as url:
        yield url
