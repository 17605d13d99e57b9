"""KVServeIngress: the OpenAI-compatible endpoint of the scale-out app.

The same FastAPI app as the single-process server (``entrypoints/openai_server``:
routes, streaming, errors, ``cache_salt``, ``usage``), built over a
:class:`RemoteEngine` instead of an in-process engine, plus
``GET /cluster/replicas`` (each replica's name, pid, seconds since its last
metrics push, start time, constructor seconds and step-time fit source; and
``router``: the replicas the request router holds state for). The tokenizer runs here, so every prompt is tokenized and hashed once.
``GET /health`` is 503 while fewer than ``min_healthy_replicas`` replicas are alive
(a killed replica's actor leaves the list at the next watch, every 0.5 s).

With ``--ingress-replicas K`` Ray Serve's proxy spreads connections over K copies of
this deployment. Each routes its own requests with its own router; the routers agree
on where prefixes live because every replica's routing report (every 0.5 s) carries
the block keys its cache holds, which correct each router's prefix index, so a
prefix routed by one ingress is known to the others within a report period.
``/metrics`` on any ingress lists every ingress's router series (``ingress`` label),
and ``/cluster/replicas`` names the ingress that answered (``ingress``; its
``router`` list is that ingress's).

With prefill/decode pools ``engine`` is the decode pool; ``prefill_pool`` (its
handle) is only bound so that Serve deploys it: the decode replicas reach it over the
KV transfer. Every replica's series and ``/cluster/replicas`` entry then carry its
``role`` (prefill or decode), and ``kvserve:cluster_pool_replicas{role}`` counts them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from ray import serve

from kvserve.cluster.protocol import EngineFacts
from kvserve.cluster.remote_engine import RemoteEngine


@serve.ingress()
class KVServeIngress:
    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        engine: Any,
        hub: Any,
        model: str | None,
        served_model_name: str | None = None,
        api_key: str | None = None,
        max_queue_len: int | None = None,
        min_healthy_replicas: int = 1,
        http_options: dict[str, Any] | None = None,
        prefill_pool: Any = None,
    ) -> None:
        import asyncio

        from kvserve.cluster.loopback import bind_serve_grpc_to_loopback
        from kvserve.model.loader import DEFAULT_MODEL_NAME, load_tokenizer

        bind_serve_grpc_to_loopback()
        facts: EngineFacts = await engine.info.remote()
        tokenizer = load_tokenizer(model or DEFAULT_MODEL_NAME)
        self.client = RemoteEngine(
            engine,
            hub,
            facts,
            tokenizer,
            min_healthy_replicas=min_healthy_replicas,
            ingress_id=serve.get_replica_context().replica_id.unique_id,
        )
        # /health: 503 while fewer than min_healthy_replicas replicas are alive.
        self._watch = asyncio.get_running_loop().create_task(self.client.watch_replicas())
        self._served_model_name = served_model_name
        self._api_key = api_key
        self._max_queue_len = max_queue_len
        self._http_options = dict(http_options or {})

    def __serve_build_asgi_app__(self) -> FastAPI:
        from kvserve.entrypoints.openai_server import build_app

        app = build_app(
            self.client,
            api_key=self._api_key,
            served_model_name=self._served_model_name,
            max_queue_len=self._max_queue_len,
            **self._http_options,
        )
        client = self.client

        @app.get("/cluster/replicas")
        async def replicas() -> dict[str, Any]:
            from kvserve.cluster.routing_state import known_replicas

            snap = await client.snapshot_replicas()
            return {
                "replicas": [
                    {
                        "replica": r,
                        "pid": v["pid"],
                        "age_s": round(v["age_s"], 3),
                        **v.get("meta", {}),
                    }
                    for r, v in sorted(snap.items())
                ],
                "router": sorted(known_replicas()),
                "ingress": client.ingress_id,
            }

        return app
