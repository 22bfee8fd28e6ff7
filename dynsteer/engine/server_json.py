"""Steering routes for clients that speak JSON: presets, the global static spec, validate and encode.

Added to :class:`~dynsteer.engine.server.SteeringEndpoints`' router (same prefix, same API-key rule):

* ``GET /presets``, ``PUT /presets/{name}`` (a :class:`~dynsteer.config.Preset`), ``DELETE /presets/{name}``:
  operator presets, held by the frontend's admission state (requests name them; admission expands them, so the
  engine core and the workers never see a preset);
* ``GET/PUT/DELETE /spec``: the global static spec (the global policy is ``/policy``); set like the policy,
  frontend state before the RPC (:meth:`SteeringEndpoints.set_global`);
* ``POST /validate``: a :class:`~dynsteer.request.json_form.SteeringObject` admitted as a request's would be,
  answered with its resolved configuration, or a 400 naming the field;
* ``POST /encode``: the same object packed (``{"packed": "ds1:..."}``), for clients that send the packed form.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, SkipValidation

from dynsteer.config import Preset
from dynsteer.engine.frontend import renamed
from dynsteer.request.json_form import SteeringObject
from dynsteer.request.payload import decode_payload
from dynsteer.spec import SteeringSpec, SteeringValidationError, check_name

FIELD = "steering"


class SpecBody(BaseModel):
    """``PUT /v1/steering/spec``: the global static spec (a ``SteeringSpec`` as JSON; null clears)."""

    model_config = ConfigDict(extra="forbid")

    spec: SkipValidation[Optional[SteeringSpec]] = Field(None, description="applied to every request")


def add_json_routes(router: APIRouter, endpoints: Any) -> None:
    """Add the routes of this module to ``router``; ``endpoints`` is the :class:`SteeringEndpoints` serving it."""

    @router.get("/presets")
    async def list_presets(request: Request) -> dict[str, Any]:
        front = endpoints.front(endpoints._engine(request))
        return {"presets": {n: p.model_dump(mode="json") for n, p in sorted(front.presets.items())}}

    @router.put("/presets/{name}")
    async def put_preset(name: str, body: Preset, request: Request) -> dict[str, Any]:
        front = endpoints.front(endpoints._engine(request))
        checked(lambda: check_name(name, "preset name"), "name", FIELD)
        checked(lambda: front.set_preset(name, body), "preset", FIELD)
        return {"name": name, "preset": body.model_dump(mode="json")}

    @router.delete("/presets/{name}")
    async def delete_preset(name: str, request: Request) -> dict[str, Any]:
        front = endpoints.front(endpoints._engine(request))
        if name not in front.presets:
            raise HTTPException(404, f"name: no preset named {name!r} is registered")
        front.set_preset(name, None)
        return {"deleted": name}

    @router.get("/spec")
    async def get_spec(request: Request) -> dict[str, Any]:
        spec = endpoints.front(endpoints._engine(request)).global_spec
        return {"spec": None if spec.is_empty() else spec.model_dump(mode="json")}

    @router.put("/spec")
    async def set_spec(body: SpecBody, request: Request) -> dict[str, Any]:
        engine = endpoints._engine(request)
        spec = SteeringSpec()
        if body.spec is not None:
            limits = endpoints.front(engine).limits
            spec = checked(lambda: decode_payload({"spec": body.spec}, field="body", limits=limits), "spec",
                           FIELD).spec
        spec, _ = await endpoints.set_global(engine, spec=spec)
        return {"spec": None if spec.is_empty() else spec.model_dump(mode="json")}

    @router.delete("/spec")
    async def clear_spec(request: Request) -> dict[str, Any]:
        await endpoints.set_global(endpoints._engine(request), spec=SteeringSpec())
        return {"spec": None}

    @router.post("/validate")
    async def validate(body: SteeringObject, request: Request) -> dict[str, Any]:
        front = endpoints.front(endpoints._engine(request))
        packed = checked(lambda: front.pack(body.as_dict(), FIELD), FIELD, FIELD)
        decoded = decode_payload(packed, limits=front.limits)

        def admitted() -> Any:
            front.admit_uncached(packed)  # the fit to the model: what a request's admission checks
            return front.effective(decoded)

        effective = checked(admitted, FIELD, FIELD)
        return {"request": {"spec": decoded.spec.model_dump(mode="json"), "policy": _dump(decoded.policy),
                            "capture": _dump(decoded.capture), "tag": decoded.tag, "trace": decoded.trace},
                "effective": {"specs": [{"source": "global" if source.startswith("global") else "request",
                                         "spec": spec.model_dump(mode="json")}
                                        for source, spec in effective.specs],
                              "policy": _dump(effective.policy)},
                "packed": packed}

    @router.post("/encode")
    async def encode(body: SteeringObject, request: Request) -> dict[str, Any]:
        front = endpoints.front(endpoints._engine(request))
        return {"packed": checked(lambda: front.pack(body.as_dict(), FIELD), FIELD, FIELD)}


def _dump(model: Any) -> Any:
    return None if model is None else model.model_dump(mode="json", exclude_none=True)


def checked(fn: Any, field: str, payload_field: str | None = None) -> Any:
    """``fn()``, its validation error a 400: a ``SteeringValidationError`` names its own field (a payload's default
    field renamed to ``payload_field`` where given), any other ``ValueError`` / ``TypeError`` is put under
    ``field``. The steering routes of both modules answer through it."""
    try:
        return fn()
    except SteeringValidationError as exc:
        raise HTTPException(400, str(exc if payload_field is None else renamed(exc, payload_field))) from None
    except (ValueError, TypeError) as exc:
        raise HTTPException(400, f"{field}: {exc}") from None
