"""Steering endpoints on vLLM's OpenAI-compatible server: named vectors, the global policy, capabilities (and, from
:mod:`dynsteer.engine.server_json`, presets, the global spec, validate and encode; from
:mod:`dynsteer.engine.stream_routes`, the monitors' start handshake).

vLLM 0.26's seam for extra routes is the endpoint plugin (``vllm/plugins/endpoint_plugins/interface.py``): an object
with ``attach_router(app)`` (called in ``build_app`` after the core routers) and ``async init_state(engine_client,
state, args)`` (called in ``init_app_state``). :class:`SteeringEndpoints` is one. ``dynsteer serve`` (:func:`serve`:
vLLM's own serve parser and command, in this process) hands it to vLLM by adding it to what
``vllm.plugins.load_endpoint_plugins`` returns (:func:`install`), so no entry point and no ``VLLM_PLUGINS`` allowlist
is involved, and plain ``vllm serve`` never exposes these routes.

Changes reach the engine the way :class:`dynsteer.Steerer` sends them (``collective_rpc`` with the worker methods of
:mod:`dynsteer.engine.worker_ext`), and the frontend's admission state (:mod:`dynsteer.engine.frontend`) is updated
*before* the RPC is sent, with no await in between: a request admitted after the change is salted by the new global
and its ADD message follows the RPC on the engine core's input socket; one admitted before is live when the RPC lands
and has its prefix-cache hashes forked there (``engine.command_desk``). So no block is cached under the wrong global.

Trust (architecture §10): with ``--api-key`` (or ``VLLM_API_KEY``) every steering route requires ``Authorization: Bearer
<key>`` (compared in constant time) and answers 401 without it, whatever vLLM's own middleware guards; with no key
they answer only loopback (and unix-socket) clients unless the operator passed ``--steering-allow-remote`` (403
otherwise). Bodies are pydantic models; every error is a 400 naming the field.

vLLM's development routes (``VLLM_SERVER_DEV_MODE=1``) are held to the same rule by
:class:`~dynsteer.engine.dev_routes.DevRouteGuard`, which :meth:`SteeringEndpoints.attach_router` adds.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import secrets
import sys
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np
from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dynsteer._version import __version__
from dynsteer.engine import patching
from dynsteer.engine.dev_routes import DevRouteGuard, dev_routes
from dynsteer.engine.frontend import FrontendState, frontend_state
from dynsteer.engine.keys import (APP_STATE_ATTR, HTTP_PREFIX, PAYLOAD_KEY, RPC_DESCRIBE, RPC_REGISTER_VECTOR,
                                  RPC_SET_GLOBAL, RPC_UNREGISTER_VECTOR)
from dynsteer.engine.replicas import each_replica, replica_count, rpc_in_order
from dynsteer.engine.server_json import FieldErrorRoute, add_json_routes, checked
from dynsteer.engine.stream_routes import add_stream_routes
from dynsteer.request.payload import decode_payload, encode_payload
from dynsteer.spec import SteeringSpec, SteeringValidationError, check_name, check_vector
from dynsteer.vectors import as_vector, pack_vector

logger = logging.getLogger("dynsteer")
_KEEP: Any = object()  # set_global: this part of the global configuration stays as it is


class VectorBody(BaseModel):
    """``POST /v1/steering/vectors``: register (or replace) a named vector."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="letters, digits, '.', '_', '-'; at most 128")
    vector: Union[list[float], dict[str, str]] = Field(description="a list of numbers or {'b64': <float32 LE>}")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "vector name")


class PolicyBody(BaseModel):
    """``PUT /v1/steering/policy``: the global dynamic policy (a ``DynamicSteeringPolicy`` as JSON; null clears)."""

    model_config = ConfigDict(extra="forbid")

    policy: Optional[dict[str, Any]] = None


class SteeringEndpoints:
    """A vLLM endpoint plugin serving ``/v1/steering/{vectors,policy,spec,presets,validate,encode,capabilities}``.

    Args:
        allow_remote: with no API key configured, serve non-loopback clients too (the operator's explicit choice).
    """

    name = "dynsteer"
    required_tasks = ("generate",)

    def __init__(self, allow_remote: bool = False) -> None:
        self.allow_remote = allow_remote
        self._lock = asyncio.Lock()

    # ---- vLLM's endpoint-plugin protocol -----------------------------------------------------------------------------
    def attach_router(self, app: Any) -> None:
        # vLLM registers its development routes (VLLM_SERVER_DEV_MODE) before endpoint plugins: guard them here
        dev = dev_routes(app)
        if dev:
            app.add_middleware(DevRouteGuard, endpoints=self, routes=dev)
        app.include_router(self.router())

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        import vllm.envs as envs

        keys = [k for k in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if k]
        setattr(state, APP_STATE_ATTR, {"engine": engine_client,
                                        "keys": [hashlib.sha256(k.encode()).digest() for k in keys]})
        if engine_client is not None:
            self.front(engine_client)  # build admission state now: a bad dynsteer config fails at start
        if not keys and not self.allow_remote:
            logger.info("dynsteer: no API key set; %s/* answers loopback clients only", HTTP_PREFIX)

    # ---- routes ----------------------------------------------------------------------------------------------------
    def router(self) -> APIRouter:
        router = APIRouter(prefix=HTTP_PREFIX, dependencies=[Depends(self.authorize)], route_class=FieldErrorRoute)

        @router.get("/capabilities")
        async def capabilities(request: Request) -> dict[str, Any]:
            """The model's shape, dynsteer's version and limits, the registered names: what a client may ask for."""
            return self.capabilities(self._engine(request))

        @router.get("/replicas")
        async def replicas(request: Request) -> dict[str, Any]:
            """Each data-parallel replica's steering state as its workers describe it, in replica order (one entry
            without data parallelism): named vectors, whether a global spec and policy are set, live requests."""
            replies = await each_replica(self._engine(request), RPC_DESCRIBE)
            return {"replicas": [{"replica": r, "workers": workers} for r, workers in enumerate(replies)]}

        @router.get("/vectors")
        async def list_vectors(request: Request) -> dict[str, Any]:
            """The registered vectors: name, size and norm of each."""
            front = self.front(self._engine(request))
            return {"vectors": [_vector_info(n, v) for n, v in sorted(front.named.items())]}

        @router.post("/vectors")
        async def register_vector(body: VectorBody, request: Request) -> dict[str, Any]:
            """Register (or replace) a named vector; a replaced vector the global steering uses is a 409."""
            engine = self._engine(request)
            front = self.front(engine)
            arr = checked(lambda: check_vector(as_vector(body.vector), front.shape.hidden_size, "body.vector"),
                          "body.vector")
            async with self._lock:
                try:
                    front.check_register(body.name)  # over max_named_vectors: nothing changes anywhere
                except SteeringValidationError as exc:
                    raise HTTPException(409, str(exc)) from None
                previous = front.named.get(body.name)
                if previous is not None and _references(front, body.name):
                    # the global steering's rows and live requests' cache hashes were made with the old values
                    raise HTTPException(409, f"name: vector {body.name!r} is used by the global steering; clear the "
                                             f"global policy before replacing it")
                front.register(body.name, arr)  # before the RPC, no await between (module docstring)
                try:
                    await rpc_in_order(engine, RPC_REGISTER_VECTOR, (body.name, pack_vector(arr)))
                except Exception:
                    _restore_vector(front, body.name, previous)
                    raise
            return _vector_info(body.name, arr)

        @router.delete("/vectors/{name}")
        async def delete_vector(name: str, request: Request) -> dict[str, Any]:
            """Delete a registered vector (404 if unknown; 409 while the global steering uses it)."""
            engine = self._engine(request)
            front = self.front(engine)
            async with self._lock:
                if name not in front.named:
                    raise HTTPException(404, f"name: no vector named {name!r} is registered")
                if _references(front, name):
                    raise HTTPException(409, f"name: vector {name!r} is used by the global steering; clear the "
                                             f"global policy first")
                previous = front.named.pop(name)
                front.version += 1
                try:
                    await rpc_in_order(engine, RPC_UNREGISTER_VECTOR, (name,))
                except Exception:
                    _restore_vector(front, name, previous)
                    raise
            return {"deleted": name}

        @router.get("/policy")
        async def get_policy(request: Request) -> dict[str, Any]:
            """The global dynamic policy (null: none)."""
            policy = self.front(self._engine(request)).global_policy
            return {"policy": None if policy is None else policy.model_dump(mode="json", exclude_none=True)}

        @router.put("/policy")
        async def set_policy(body: PolicyBody, request: Request) -> dict[str, Any]:
            """Set the global dynamic policy, applied to every request without its own (null clears it)."""
            return await self._set_policy(self._engine(request), body.policy)

        @router.delete("/policy")
        async def clear_policy(request: Request) -> dict[str, Any]:
            """Clear the global dynamic policy."""
            return await self._set_policy(self._engine(request), None)

        add_json_routes(router, self)  # presets, the global spec, validate, encode
        add_stream_routes(router, self)  # the monitors' start handshake
        return router

    # ---- helpers ---------------------------------------------------------------------------------------------------
    async def authorize(self, request: Request) -> None:
        """401 without the server's API key when one is set; 403 for non-loopback clients when none is (unless
        ``allow_remote``)."""
        refusal = self.refusal(getattr(request.app.state, APP_STATE_ATTR)["keys"], request.headers.get("authorization"),
                               request.client)
        if refusal is not None:
            raise HTTPException(*refusal)

    def refusal(self, keys: list[bytes], authorization: str | None, client: Any) -> tuple[int, str] | None:
        """Why a control request is refused, as ``(status, message)``, or None: the rule of :meth:`authorize`
        (``keys``: SHA-256 digests of the API keys; ``client``: an object with ``host``, None for a unix socket)."""
        if keys:
            scheme, _, token = (authorization or "").partition(" ")
            digest = hashlib.sha256(token.encode()).digest()
            ok = False
            for key in keys:
                ok |= secrets.compare_digest(digest, key)
            if scheme.lower() != "bearer" or not ok:
                return 401, ("Authorization: a valid 'Bearer <api key>' is required for steering and development "
                             "endpoints")
            return None
        if self.allow_remote or _is_local(client):
            return None
        return 403, ("steering and development endpoints answer loopback clients only when the server has no API "
                     "key (start it with --api-key, or --steering-allow-remote)")

    async def _set_policy(self, engine: Any, raw: dict[str, Any] | None) -> dict[str, Any]:
        policy = None
        if raw is not None:
            limits = self.front(engine).limits
            decoded = checked(lambda: decode_payload({"policy": raw}, field="body", limits=limits), "policy")
            policy = decoded.policy
        _, admitted = await self.set_global(engine, policy=policy)
        return {"policy": None if admitted is None else admitted.model_dump(mode="json", exclude_none=True)}

    async def set_global(self, engine: Any, spec: Any = _KEEP, policy: Any = _KEEP) -> tuple[SteeringSpec, Any]:
        """Set the global spec and/or policy (decoded; ``_KEEP``: as it is), checked against the model; returns
        them with the policy admitted. The frontend's state changes before the RPC, with no await between (module
        docstring); a failed RPC restores it. Raises a 400 naming the body's field."""
        front = self.front(engine)
        async with self._lock:
            spec = front.global_spec if spec is _KEEP else spec
            policy = front.global_policy if policy is _KEEP else policy
            try:
                admitted = front.check_global(spec, policy)
            except SteeringValidationError as exc:
                raise _bad_request(str(exc).replace("global_policy.", "body.policy.", 1)
                                   .replace("global.", "body.spec.", 1)) from None
            previous = (front.global_spec, front.global_policy)
            front.set_global(spec, admitted)  # before the RPC, no await between (module docstring)
            try:
                await rpc_in_order(engine, RPC_SET_GLOBAL, (encode_payload(spec, policy=admitted),))
            except Exception:
                front.set_global(*previous)
                raise
        return spec, admitted

    def capabilities(self, engine: Any) -> dict[str, Any]:
        from dynsteer.config import DynsteerConfig

        front = self.front(engine)
        shape = front.shape
        cfg = DynsteerConfig.from_additional(engine.vllm_config.additional_config)
        layers = list(range(shape.num_layers)) if shape.layers is None else list(shape.layers)
        return {"dynsteer": __version__, "model": shape.model_id, "architecture": shape.architecture,
                "num_layers": shape.num_layers, "hidden_size": shape.hidden_size, "sites": list(shape.sites),
                "layers": layers, "tiers": ["base", "prefill", "decode"], "max_clamps": shape.max_clamps,
                "max_gates": shape.max_gates, "dynamic": shape.max_gates > 0, "max_rows": cfg.max_rows,
                "capture_places": sorted(f"{layer}.{site}" for layer, site in front.capture_places),
                "vectors": sorted(front.named), "probes": sorted(front.probes),
                "controllers": sorted(front.controllers), "limits": front.limits.model_dump(mode="json"),
                "payload_key": PAYLOAD_KEY, "data_parallel_size": replica_count(engine.vllm_config)}

    @staticmethod
    def front(engine: Any) -> FrontendState:
        return frontend_state(engine.input_processor)

    @staticmethod
    def _engine(request: Any) -> Any:
        engine = getattr(request.app.state, APP_STATE_ATTR)["engine"]
        if engine is None:
            raise HTTPException(503, "this server has no engine")
        return engine


def _bad_request(message: str) -> Exception:
    return HTTPException(400, message)


def _vector_info(name: str, arr: np.ndarray) -> dict[str, Any]:
    return {"name": name, "hidden_size": int(arr.shape[0]), "norm": float(np.linalg.norm(arr.astype(np.float64)))}


def _restore_vector(front: FrontendState, name: str, previous: np.ndarray | None) -> None:
    if previous is None:
        front.named.pop(name, None)
        front.version += 1
    else:
        front.register(name, previous)


def _references(front: FrontendState, name: str) -> bool:
    """Whether the global spec or policy names vector ``name``."""
    text = front.global_spec.model_dump_json()
    if front.global_policy is not None:
        text += front.global_policy.model_dump_json()
    return f'"{name}"' in text


def _is_local(client: Any) -> bool:
    if client is None or not client.host:  # a unix socket
        return True
    try:
        return ipaddress.ip_address(client.host).is_loopback
    except ValueError:
        return False


_installed: list[SteeringEndpoints] = []  # what install() made last: the endpoints vLLM's server here loads


def install(allow_remote: bool = False) -> SteeringEndpoints:
    """Make vLLM's API server in this process load :class:`SteeringEndpoints` with its endpoint plugins (the last
    installed ones, where this is called again)."""
    import vllm.plugins as plugins

    endpoints = SteeringEndpoints(allow_remote=allow_remote)
    _installed[:] = [endpoints]
    orig = plugins.load_endpoint_plugins

    def load_endpoint_plugins(supported_tasks: Any = None) -> list[Any]:
        current = _installed[0]
        loaded = [p for p in orig(supported_tasks) if getattr(p, "name", None) != current.name]
        if supported_tasks is None or set(current.required_tasks) & set(supported_tasks):
            loaded.append(current)
        return loaded

    patching.patch(plugins, "load_endpoint_plugins", load_endpoint_plugins,
                   why="vLLM's API server loads dynsteer's steering endpoints (dynsteer serve only)")
    import starlette.requests

    from dynsteer.engine.request_json import patch_request_json

    patch_request_json(starlette.requests.Request)
    return endpoints


ALLOW_REMOTE = "--steering-allow-remote"


def serve_parser() -> tuple[Any, Any]:
    """vLLM's ``serve`` parser with dynsteer's one option added."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="dynsteer", description="vLLM's OpenAI-compatible server with dynsteer's "
                                                                 "steering endpoints (/v1/steering/...).")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    sub = command.subparser_init(subparsers)
    sub.usage = "dynsteer serve [model_tag] [vLLM serve options] [--steering-allow-remote]"
    group = sub.add_argument_group("dynsteer", "dynsteer's steering endpoints (/v1/steering/vectors, /policy, "
                                               "/capabilities); --help=dynsteer")
    group.add_argument(ALLOW_REMOTE, action="store_true", default=False,
                       help="with no --api-key, serve /v1/steering/* to non-loopback clients too "
                            "(default: loopback and unix-socket clients only)")
    sub.set_defaults(dispatch_function=command.cmd)
    return parser, command


def serve(argv: Sequence[str]) -> None:
    """``vllm serve`` with ``argv`` (its options plus ``--steering-allow-remote``) and the steering endpoints, in this
    process: vLLM's parser, validation and ``ServeSubcommand.cmd``, after :func:`install`."""
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    parser, command = serve_parser()
    args = parser.parse_args(["serve", *argv])
    command.validate(args)
    if args.api_server_count is None:
        # vLLM would start one API server per data-parallel replica; the frontend's admission state (global
        # steering, named vectors) lives in one, and its control RPCs reach every replica
        args.api_server_count = 1
    if getattr(args, "headless", False) or (args.api_server_count or 1) > 1 or getattr(args, "grpc", False):
        sys.exit("dynsteer serve: the steering endpoints need a single HTTP API server in this process "
                 "(no --headless, --grpc or --api-server-count > 1)")
    install(allow_remote=args.steering_allow_remote)
    args.dispatch_function(args)
