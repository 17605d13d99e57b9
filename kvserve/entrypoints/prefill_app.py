"""The HTTP side of a prefill worker (``kvserve serve --kv-role prefill``): only
``GET /health`` and ``GET /metrics``; prefill work arrives on ``--kv-address``.

The lifespan starts the engine thread and the :class:`PrefillService` on the
server's event loop, and stops both (closing the KV transport) on shutdown.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.metrics import CONTENT_TYPE
from kvserve.kv_transfer.prefill_service import PrefillService


def build_prefill_app(async_engine: AsyncEngine, service: PrefillService) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        service.start()
        yield
        await async_engine.shutdown()

    app = FastAPI(title="kvserve prefill worker", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> Response:
        if async_engine.is_healthy:
            return Response(status_code=200)
        body = {
            "error": {
                "message": "the engine is not running",
                "type": "server_error",
                "param": None,
                "code": 503,
            }
        }
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE)

    return app
