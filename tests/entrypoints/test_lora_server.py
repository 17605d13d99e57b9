"""The LoRA HTTP surface on the real default model: ``--lora-modules`` at start,
``model`` selecting an adapter, load/unload endpoints, ``/v1/models``, and the 4xx
answers for bad adapters and unknown names."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.lora_adapters import make_adapter
from support.server_helpers import serve_thread

from kvserve.engine.args import build_engine_config
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine_core import EngineCore
from kvserve.entrypoints.openai_server import build_app

pytestmark = pytest.mark.usefixtures("single_thread_torch")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, loaded_model) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("adapters")
    cfg = loaded_model.hf_config
    return {
        "sql": make_adapter(tmp / "sql", cfg, rank=8, seed=11),
        "chat": make_adapter(tmp / "chat", cfg, rank=4, seed=12),
        "big": make_adapter(tmp / "big", cfg, rank=32, seed=13, layers=[0]),
        "wrong": make_adapter(
            tmp / "wrong", cfg, rank=4, seed=14, layers=[0], shape_override={"q_proj": (4, 100)}
        ),
    }


@pytest.fixture(scope="module")
def server(folders: dict[str, Path], loaded_model) -> Iterator[tuple[str, EngineCore]]:
    config = build_engine_config(
        dtype="float32",
        quantization="none",
        max_model_len=512,
        max_step_ms=0,
        enable_lora=True,
        lora_modules=[f"sql={folders['sql']}"],
        max_loras=2,
        max_lora_rank=16,
    )
    core = EngineCore(config, loaded=loaded_model)
    with serve_thread(build_app(AsyncEngine(core), served_model_name="base")) as url:
        yield url, core


def complete(url: str, model: str, max_tokens: int = 8) -> httpx.Response:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_models_lists_adapters_and_model_selects_one(server, folders) -> None:
    url, core = server
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert ids == ["base", "sql"]
    card = httpx.get(f"{url}/v1/models/sql").json()
    assert card["parent"] == "base" and card["root"] == str(folders["sql"])
    base = complete(url, "base").json()
    sql = complete(url, "sql").json()
    assert sql["model"] == "sql" and base["model"] == "base"
    assert sql["choices"][0]["text"] != base["choices"][0]["text"]
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert chat.status_code == 200 and chat.json()["model"] == "sql"


def test_load_use_and_unload(server, folders) -> None:
    url, core = server
    r = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "chat", "lora_path": str(folders["chat"])},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert "chat" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert complete(url, "chat").status_code == 200
    # slots full (max_loras=2): a clear 409
    r = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(folders["chat"])}
    )
    assert r.status_code == 409 and "slots are taken" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=60)
    assert r.status_code == 200, r.text
    assert complete(url, "chat").status_code == 404
    assert (
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404
    )


@pytest.mark.parametrize(
    ("body", "status", "text"),
    [
        ({"lora_name": "b", "lora_path": "big"}, 400, "over --max-lora-rank 16"),
        ({"lora_name": "w", "lora_path": "wrong"}, 400, "the base model needs"),
        ({"lora_name": "m", "lora_path": "/no/such/folder"}, 400, "is not a folder"),
        ({"lora_name": "sql", "lora_path": "big"}, 409, "already loaded"),
        ({"lora_name": "m"}, 400, "lora_path is required"),
    ],
)
def test_bad_loads_are_4xx(server, folders, body, status: int, text: str) -> None:
    url, _ = server
    if body.get("lora_path") in folders:
        body = {**body, "lora_path": str(folders[body["lora_path"]])}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert text in r.json()["error"]["message"]


def test_unknown_model_is_404(server) -> None:
    url, _ = server
    r = complete(url, "nope")
    assert r.status_code == 404
    assert "sql" in r.json()["error"]["message"]  # it lists what is loaded


def test_unload_waits_for_running_requests(server, folders) -> None:
    url, core = server
    r = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "slow", "lora_path": str(folders["chat"])},
        timeout=60,
    )
    assert r.status_code == 200
    results: dict[str, object] = {}

    def long_request() -> None:
        results["gen"] = complete(url, "slow", max_tokens=48)
        results["gen_done"] = time.monotonic()

    t = threading.Thread(target=long_request)
    t.start()
    manager = core.lora_manager
    assert manager is not None
    deadline = time.monotonic() + 60
    while manager.in_use("slow") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.in_use("slow") == 1
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "slow"}, timeout=120)
    unloaded = time.monotonic()
    t.join()
    assert r.status_code == 200
    gen = results["gen"]
    assert isinstance(gen, httpx.Response) and gen.status_code == 200
    assert gen.json()["usage"]["completion_tokens"] == 48  # it ran to the end
    assert unloaded >= results["gen_done"] - 0.5  # the unload returned after it
    assert manager.in_use("slow") == 0
