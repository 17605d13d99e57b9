"""The LoRA endpoints: ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``
(vLLM's bodies, ``{"lora_name": ..., "lora_path": ...}``) and the adapters' model cards
in ``/v1/models``.

Loading reads and checks the folder on a worker thread (400 for a bad adapter, 409
when the name is taken or every slot is full). Unloading an adapter in use waits for
its requests: new requests naming it get 404 at once, the call returns when the last
running one has finished (409 and the adapter stays when that takes longer than
``unload_timeout_s``). Both answer 404 when the server runs without ``--enable-lora``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from kvserve.entrypoints.openai_errors import APIError, bad_request
from kvserve.entrypoints.openai_serving import OpenAIServing, lora_error_to_api
from kvserve.lora.errors import LoRAError
from kvserve.lora.manager import LoRAManager

UNLOAD_POLL_S = 0.02
DEFAULT_UNLOAD_TIMEOUT_S = 600.0


def lora_cards(serving: OpenAIServing, created: int, max_model_len: int) -> list[dict[str, Any]]:
    """One model card per resident adapter (vLLM's: ``root`` the folder, ``parent``
    the base model's served name)."""
    if serving.lora is None:
        return []
    return [
        {
            "id": a.name,
            "object": "model",
            "created": created,
            "owned_by": "kvserve",
            "root": a.path,
            "parent": serving.served_model_name,
            "max_model_len": max_model_len,
        }
        for a in serving.lora.adapters()
    ]


async def _body(request: Request, need_path: bool) -> tuple[str, str | None]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise bad_request('the body must be JSON, e.g. {"lora_name": "sql"}') from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object with lora_name")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name:
        raise bad_request("lora_name is required: a non-empty string", param="lora_name")
    if need_path and (not isinstance(path, str) or not path):
        raise bad_request(
            "lora_path is required: the PEFT adapter folder on the server", param="lora_path"
        )
    return name, path if isinstance(path, str) else None


def _manager(serving: OpenAIServing) -> LoRAManager:
    if serving.lora is None:
        raise APIError(
            404,
            "this server serves no LoRA adapters: start it with --enable-lora",
            code="lora_disabled",
        )
    return serving.lora


def add_lora_routes(
    app: FastAPI, serving: OpenAIServing, unload_timeout_s: float = DEFAULT_UNLOAD_TIMEOUT_S
) -> None:
    """Register the two endpoints on ``app``."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        manager = _manager(serving)
        name, path = await _body(request, need_path=True)
        if name == serving.served_model_name:
            raise bad_request(
                f"lora_name {name!r} is the base model's name: pick another", param="lora_name"
            )
        try:
            assert path is not None
            await asyncio.to_thread(manager.load, name, path)
        except LoRAError as e:
            raise lora_error_to_api(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        manager = _manager(serving)
        name, _ = await _body(request, need_path=False)
        try:
            manager.begin_unload(name)
        except LoRAError as e:
            raise lora_error_to_api(e) from None
        deadline = time.monotonic() + unload_timeout_s
        while not manager.finish_unload(name):
            if time.monotonic() > deadline:
                manager.cancel_unload(name)
                raise APIError(
                    409,
                    f"LoRA adapter {name!r} still has {manager.in_use(name)} running "
                    f"requests after {unload_timeout_s:g} s: it stays loaded; retry later",
                    code="conflict",
                )
            await asyncio.sleep(UNLOAD_POLL_S)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
