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

import re
from typing import Any, Optional

from fastapi import APIRouter, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, SkipValidation

from dynsteer.config import Preset
from dynsteer.engine.frontend import renamed
from dynsteer.request.json_form import SteeringObject
from dynsteer.request.payload import decode_payload
from dynsteer.spec import SteeringSpec, SteeringValidationError, check_name, error_text, field_path

FIELD = "steering"


class SpecBody(BaseModel):
    """``PUT /v1/steering/spec``: the global static spec (a ``SteeringSpec`` as JSON; null clears)."""

    model_config = ConfigDict(extra="forbid")

    spec: SkipValidation[Optional[SteeringSpec]] = Field(None, description="applied to every request")


def add_json_routes(router: APIRouter, endpoints: Any) -> None:
    """Add the routes of this module to ``router``; ``endpoints`` is the :class:`SteeringEndpoints` serving it."""

    @router.get("/presets")
    async def list_presets(request: Request) -> dict[str, Any]:
        """The registered presets."""
        front = endpoints.front(endpoints._engine(request))
        return {"presets": {n: p.model_dump(mode="json") for n, p in sorted(front.presets.items())}}

    @router.put("/presets/{name}")
    async def put_preset(name: str, body: Preset, request: Request) -> dict[str, Any]:
        """Register (or replace) a preset, checked against the model."""
        front = endpoints.front(endpoints._engine(request))
        checked(lambda: check_name(name, "preset name"), "name", FIELD)
        checked(lambda: front.set_preset(name, body, field="body"), "body", FIELD)
        return {"name": name, "preset": body.model_dump(mode="json")}

    @router.delete("/presets/{name}")
    async def delete_preset(name: str, request: Request) -> dict[str, Any]:
        """Delete a preset (404 if unknown)."""
        front = endpoints.front(endpoints._engine(request))
        if name not in front.presets:
            raise HTTPException(404, f"name: no preset named {name!r} is registered")
        front.set_preset(name, None)
        return {"deleted": name}

    @router.get("/spec")
    async def get_spec(request: Request) -> dict[str, Any]:
        """The global static spec (null: none)."""
        spec = endpoints.front(endpoints._engine(request)).global_spec
        return {"spec": None if spec.is_empty() else spec.model_dump(mode="json")}

    @router.put("/spec")
    async def set_spec(body: SpecBody, request: Request) -> dict[str, Any]:
        """Set the global static spec, applied to every request (null clears it)."""
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
        """Clear the global static spec."""
        await endpoints.set_global(endpoints._engine(request), spec=SteeringSpec())
        return {"spec": None}

    @router.post("/validate")
    async def validate(body: SteeringObject, request: Request) -> dict[str, Any]:
        """Admit a steering object as a request's would be: its resolved configuration and packed form."""
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
        """Pack a steering object: ``{"packed": "ds1:..."}``, for clients that send the packed form."""
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


class FieldErrorRoute(APIRoute):
    """A steering route whose malformed body is a 400 in the ``field: message`` form of every other dynsteer error.

    FastAPI validates a route's body before the handler runs and raises ``RequestValidationError``, which vLLM's
    server answers with pydantic's raw error list; catching it in the route (not with an app-wide handler, which
    vLLM registers after the plugin and which would change vLLM's own routes too) keeps the rule to these routes.
    The body is named ``body`` (``steering`` for ``/validate`` and ``/encode``, whose body is a request's steering
    object), path parameters by their name."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()
        root = FIELD if self.path.endswith(("/validate", "/encode")) else "body"

        async def route(request: Request) -> Any:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                raise HTTPException(400, body_error(exc.errors(), root)) from None

        return route


def body_error(errors: Any, root: str = "body") -> str:
    """The first of FastAPI's request-validation errors as ``field: message`` (``body.spec.vectors[0].layer``)."""
    if not errors:
        return f"{root}: invalid"
    err = errors[0]
    loc = list(err.get("loc") or ())
    if err.get("type") == "json_invalid":
        return f"{root}: malformed JSON ({err.get('ctx', {}).get('error', 'cannot be parsed')})"
    if loc and loc[0] == "body":
        loc[0] = root
    elif loc and loc[0] in ("path", "query"):
        loc = loc[1:]
    if err.get("type") == "extra_forbidden" and loc:  # the client's own key: shown, made harmless
        key = "".join(c if c.isalnum() or c in "_-" else "?" for c in str(loc[-1]))[:40] or "?"
        return f"{field_path(loc[:-1]) or root}.{key}: unknown field"
    text = error_text(err)
    if err.get("type") == "missing" and len(loc) == 1:
        text = "a JSON object is required" if loc[0] == root else text
    if _NAMED.match(text):  # a model validator's message names its field already: under the body's path
        return f"{field_path(loc) or root}.{text}"
    return f"{field_path(loc) or root}: {text[:1].lower()}{text[1:]}"


_NAMED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*|\[\d+\])*: ")
