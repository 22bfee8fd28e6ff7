"""vLLM's development routes under dynsteer: the steering routes' rule, and no ``dynsteer_*`` state change.

vLLM's development routes (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, ``/sleep``, ``/reset_prefix_cache``,
``/pause``, ``/update_weights``, ...) lie outside the prefixes vLLM's ``--api-key`` middleware guards, and
``/collective_rpc`` calls any worker method, dynsteer's included. :class:`DevRouteGuard` holds them to the same rule
as the steering routes (:meth:`dynsteer.engine.server.SteeringEndpoints.refusal`, under ``dynsteer serve``), and
``/collective_rpc`` refuses the ``dynsteer_*`` methods other than ``dynsteer_describe`` even with the key (under plain
``vllm serve`` too: :func:`patch_dev_routes`): they would change (or take) the workers' steering state behind the
frontend's admission state (named vectors it validates against, the global it salts prefix-cache keys with), so
only ``/v1/steering/*`` changes steering.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

from fastapi import Request
from starlette.routing import Match

from dynsteer.engine import patching
from dynsteer.engine.keys import APP_STATE_ATTR, HTTP_PREFIX, RPC_DESCRIBE, RPC_PREFIX


class KeyRule(Protocol):
    """Who may use the steering routes (:class:`dynsteer.engine.server.SteeringEndpoints`)."""

    def refusal(self, keys: list[bytes], authorization: str | None, client: Any) -> tuple[int, str] | None:
        """Why a control request is refused, as ``(status, message)``, or None."""


#: modules of vLLM 0.26's development routes (``vllm.entrypoints.serve.register_vllm_dev_api_routers``)
DEV_ROUTE_MODULES = ("vllm.entrypoints.serve.dev.",)
RPC_ROUTE = "/collective_rpc"
#: the dynsteer worker methods ``/collective_rpc`` may call (read only)
RPC_ALLOWED = frozenset({RPC_DESCRIBE})
_MAX_RPC_BODY = 1 << 20


@dataclass(frozen=True)
class GuardedRoute:
    """One of vLLM's development routes as a request is matched against it: the route itself, and the prefix of the
    routers it was included through where FastAPI keeps that apart (FastAPI 0.16x includes a router by reference:
    ``app.router.routes`` then holds the included router, whose routes carry their own paths only)."""

    route: Any
    prefix: str = ""

    @property
    def path(self) -> str:
        return self.prefix + str(getattr(self.route, "path", ""))

    def matches(self, scope: Any) -> bool:
        if self.prefix:
            path = scope.get("path", "")
            if not path.startswith(self.prefix):
                return False
            scope = {**scope, "path": path[len(self.prefix):]}
        return self.route.matches(scope)[0] != Match.NONE


def _leaf_routes(routes: Sequence[Any], prefix: str = "") -> Iterator[tuple[Any, str]]:
    """Every route an app serves, with the prefix it is included under: routes included by copy (FastAPI before
    0.16x) are leaves already; a router included by reference is walked into."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            context = getattr(route, "include_context", None)
            yield from _leaf_routes(inner.routes, prefix + (getattr(context, "prefix", "") or ""))
        else:
            yield route, prefix


def dev_routes(app: Any) -> list[GuardedRoute]:
    """The app's routes that vLLM's development routers registered, however FastAPI included them."""
    return [GuardedRoute(route, prefix) for route, prefix in _leaf_routes(app.router.routes)
            if getattr(getattr(route, "endpoint", None), "__module__", "").startswith(DEV_ROUTE_MODULES)]


def patch_dev_routes(module: Any) -> None:
    """In any vLLM API server with dynsteer loaded (plain ``vllm serve`` too, where no steering routes exist):
    ``/collective_rpc`` refuses dynsteer's state-changing methods (:class:`DevRouteGuard` without a key rule; under
    ``dynsteer serve`` the endpoint plugin adds the key rule). ``module``: ``vllm.entrypoints.serve``, whose
    ``register_vllm_dev_api_routers`` vLLM's ``build_app`` looks up when the app is built."""
    orig = module.register_vllm_dev_api_routers

    @functools.wraps(orig)
    def register_vllm_dev_api_routers(app: Any) -> None:
        orig(app)
        routes = dev_routes(app)
        if routes:
            app.add_middleware(DevRouteGuard, endpoints=None, routes=routes)

    patching.patch(module, "register_vllm_dev_api_routers", register_vllm_dev_api_routers,
                   why="/collective_rpc refuses dynsteer's state-changing methods (plain vllm serve too)")


class DevRouteGuard:
    """ASGI middleware holding vLLM's development routes to the steering routes' rule (:meth:`SteeringEndpoints.
    refusal`; skipped with ``endpoints=None``, where no steering routes exist), and refusing ``dynsteer_*`` methods
    other than :data:`RPC_ALLOWED` on ``/collective_rpc`` (module docstring). A route counts when Starlette's own
    matching says so, so root paths and methods are read as the router reads them."""

    def __init__(self, app: Any, endpoints: KeyRule | None, routes: Sequence[GuardedRoute]) -> None:
        self.app, self.endpoints, self.routes = app, endpoints, list(routes)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = next((r for r in self.routes if r.matches(scope)), None)
        if route is None:
            return await self.app(scope, receive, send)
        if self.endpoints is not None:
            state = getattr(scope["app"].state, APP_STATE_ATTR, None)
            if state is None:  # before the plugin's init_state: nothing to check against, so nothing is served
                return await _error(send, 503, "the server is starting")
            request = Request(scope)  # headers and client as the steering routes read them (the body is not read)
            refusal = self.endpoints.refusal(state["keys"], request.headers.get("authorization"), request.client)
            if refusal is not None:
                return await _error(send, *refusal)
        if route.path == RPC_ROUTE:
            body = b""
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                body += message.get("body", b"")
                if len(body) > _MAX_RPC_BODY:
                    return await _error(send, 413, f"body: over {_MAX_RPC_BODY} bytes")
                if not message.get("more_body", False):
                    break
            try:
                method = json.loads(body).get("method")
            except (ValueError, AttributeError, RecursionError):
                method = None  # not a JSON object: the route answers it
            if isinstance(method, str) and method.startswith(RPC_PREFIX) and method not in RPC_ALLOWED:
                return await _error(send, 403, f"method: {method[:64]!r} is not callable through {RPC_ROUTE}: it "
                                               f"would change or take the workers' steering state behind the "
                                               f"frontend's admission state; use {HTTP_PREFIX}/* (allowed here: "
                                               f"{', '.join(sorted(RPC_ALLOWED))})")
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the already read ``body`` to the app, then defers to the client's."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Any:
        return pending.pop() if pending else await receive()

    return replay


async def _error(send: Any, status: int, message: str) -> None:
    """An error answer in vLLM's JSON error shape."""
    payload = json.dumps({"error": {"message": message, "type": HTTPStatus(status).phrase, "param": None,
                                    "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
