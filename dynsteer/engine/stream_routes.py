"""The start handshake of monitors on the OpenAI server: ``GET /v1/steering/streams/{name}/subscribers``.

Added to :class:`~dynsteer.engine.server.SteeringEndpoints`' router (same prefix, same API-key rule). Query
``min`` (default 1) and ``timeout_s`` (default 0: answer at once): the route waits until at least ``min``
subscribers are connected to stream ``name`` on the engine's hubs (:mod:`dynsteer.streams.readiness`) and answers
``{"stream", "subscribers": [names], "ready": true}`` (under data parallelism a subscriber counts once it is
connected at every replica); after ``timeout_s`` without them, 504 with a message naming
how many are connected and who. An unknown stream is a 404 naming it; a bad ``min`` or ``timeout_s``, or an
engine without a hub (or whose hub requires CURVE), a 400 naming the field.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, HTTPException, Request

from dynsteer.engine.build import hub_endpoints
from dynsteer.engine.replicas import replica_count
from dynsteer.engine.server_json import checked
from dynsteer.streams.readiness import SubscriberWait

FIELD = "streams"


def add_stream_routes(router: APIRouter, endpoints: Any) -> None:
    """Add the routes of this module to ``router``; ``endpoints`` is the :class:`SteeringEndpoints` serving it."""

    @router.get("/streams/{name}/subscribers")
    async def stream_subscribers(name: str, request: Request, min: int = 1, timeout_s: float = 0.0) -> dict[str, Any]:
        engine = endpoints._engine(request)
        hubs = checked(lambda: hub_endpoints(engine.vllm_config), "monitor", FIELD)
        replicas = replica_count(engine.vllm_config)
        wait = checked(lambda: SubscriberWait(hubs, name, min, timeout_s, replicas), "min", FIELD)
        try:
            while not await asyncio.to_thread(wait.poll):  # a stats request blocks up to its timeout
                await asyncio.sleep(wait.pause())
        except LookupError as exc:
            raise HTTPException(404, str(exc.args[0])) from None
        except TimeoutError as exc:
            raise HTTPException(504, str(exc)) from None
        return {"stream": name, "subscribers": wait.names, "ready": True}
