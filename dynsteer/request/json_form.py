"""Steering written as JSON by any HTTP client, and operator presets, turned into the packed payload.

A request's steering reaches admission in one of these forms (:data:`FORMS`):

* a packed ``ds1:`` string (:func:`~dynsteer.request.payload.encode_payload`): used as is;
* a JSON object (a dict in-process, the OpenAI server's top-level ``steering`` field) or the same object as a JSON
  string (``vllm_xargs.dynsteer``): the payload schema of the Python API (``spec``, ``policy``, ``capture``,
  ``tag``, ``trace``; vectors by registered name, as lists of numbers or ``{"b64": ...}``);
* ``{"preset": name, "params": {...}}``, optionally with the object's other keys: an operator-registered
  :class:`~dynsteer.config.Preset` with its ``"$param"`` placeholders replaced.

:func:`pack_json` validates the object through :func:`~dynsteer.request.payload.decode_payload` (its object path:
the one schema, so any key it accepts passes through) and packs it with
:func:`~dynsteer.request.payload.pack_decoded`: the engine core and the workers only ever see the packed form, and
a JSON request shares every memo entry with the packed request of the same configuration.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, SkipValidation

from dynsteer.capture.spec import CaptureSpec
from dynsteer.config import DEFAULT_LIMITS, Limits, Preset
from dynsteer.policy import DynamicSteeringPolicy
from dynsteer.request.payload import decode_payload, pack_decoded
from dynsteer.spec import SteeringSpec, SteeringValidationError

PACKED_PREFIX = "ds1:"

#: What every form error says (the field it names comes first).
FORMS = ("steering is accepted as a packed 'ds1:' string or a JSON object string in vllm_xargs.dynsteer, a "
         "top-level 'steering' object, or a preset: {\"preset\": name, \"params\": {...}}")


class SteeringObject(BaseModel):
    """A request's steering as JSON: the top-level ``steering`` field of ``/v1/completions`` and
    ``/v1/chat/completions``, the body of ``/v1/steering/validate`` and ``/v1/steering/encode``.

    The fields are documented here (and in the server's OpenAPI document) but validated by the payload decoder,
    whose errors name the field (``steering.spec.vectors[0].layer``); other keys the payload schema accepts pass
    through.
    """

    model_config = ConfigDict(extra="allow")

    spec: SkipValidation[Optional[SteeringSpec]] = Field(None, description="static steering of this request")
    policy: SkipValidation[Optional[DynamicSteeringPolicy]] = Field(None, description="dynamic steering policy")
    capture: SkipValidation[Optional[CaptureSpec]] = Field(None, description="activations to capture")
    tag: SkipValidation[Optional[str]] = Field(None, description="correlation tag (names capture files)")
    trace: SkipValidation[Optional[bool]] = Field(None, description="keep the dynamic-steering trace")
    preset: SkipValidation[Optional[str]] = Field(None, description="name of a registered preset")
    params: SkipValidation[Optional[dict[str, float]]] = Field(None, description="the preset's parameters")

    def as_dict(self) -> dict[str, Any]:
        """The object as the client sent it (unvalidated)."""
        return {**{k: getattr(self, k) for k in self.model_fields_set if k in type(self).model_fields},
                **(self.model_extra or {})}


def is_packed(payload: Any) -> bool:
    return isinstance(payload, str) and payload.startswith(PACKED_PREFIX)


def parse_json(payload: Any, field: str, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """A JSON form as an object: a dict as is, a string parsed. Raises :class:`SteeringValidationError` naming
    ``field`` and listing the accepted forms for anything else."""
    if isinstance(payload, str):
        if len(payload) > limits.max_payload_bytes:
            raise SteeringValidationError(f"{field}: payload of {len(payload)} bytes exceeds the engine's limit "
                                          f"max_payload_bytes = {limits.max_payload_bytes}")
        if not payload.lstrip().startswith("{"):
            raise SteeringValidationError(f"{field}: not a packed payload (it must start with {PACKED_PREFIX!r}) nor "
                                          f"a JSON object; {FORMS}")
        try:
            payload = json.loads(payload)
        except (ValueError, RecursionError) as exc:
            raise SteeringValidationError(f"{field}: malformed JSON ({exc}); {FORMS}") from None
    if not isinstance(payload, dict):
        raise SteeringValidationError(f"{field}: expected an object, got {type(payload).__name__}; {FORMS}")
    return payload


def expand_preset(obj: dict[str, Any], field: str, presets: Mapping[str, Preset]) -> dict[str, Any]:
    """``obj`` with its ``preset``/``params`` replaced by the preset's spec and policy, placeholders filled in.
    Raises :class:`SteeringValidationError` naming the field (an unknown preset, an undeclared parameter, a value
    out of range, a key both the preset and the request set)."""
    if "preset" not in obj:
        if "params" in obj:
            raise SteeringValidationError(f"{field}.params: parameters need a preset ({field}.preset)")
        return obj
    name, given = obj["preset"], obj.get("params") or {}
    if not isinstance(name, str) or name not in presets:
        shown = name if isinstance(name, str) and len(name) <= 64 else "?"
        raise SteeringValidationError(f"{field}.preset: no preset named {shown!r} is registered (registered: "
                                      f"{', '.join(sorted(presets)) or 'none'})")
    preset = presets[name]
    if not isinstance(given, dict):
        raise SteeringValidationError(f"{field}.params: expected an object of numbers")
    values = {}
    for key, value in given.items():
        param = preset.params.get(key)
        if param is None:
            shown = key if len(str(key)) <= 64 else "?"
            raise SteeringValidationError(f"{field}.params.{shown}: preset {name!r} declares no such parameter "
                                          f"(it declares: {', '.join(sorted(preset.params)) or 'none'})")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise SteeringValidationError(f"{field}.params.{key}: expected a number")
        if (param.min is not None and value < param.min) or (param.max is not None and value > param.max):
            raise SteeringValidationError(f"{field}.params.{key}: {value} is outside [{param.min}, {param.max}]")
        values[key] = value
    for key, param in preset.params.items():
        values.setdefault(key, param.default)
    body = {k: v for k, v in obj.items() if k not in ("preset", "params")}
    for key in ("spec", "policy"):
        section = getattr(preset, key)
        if section is None:
            continue
        if body.get(key) is not None:
            raise SteeringValidationError(f"{field}.{key}: preset {name!r} sets it already")
        body[key] = _fill(section, values)
    return body


def _fill(node: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(node, str) and node.startswith("$"):
        return values[node[1:]]  # Preset checks that every placeholder is declared
    if isinstance(node, dict):
        return {k: _fill(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, values) for v in node]
    return node


def pack_json(payload: Any, field: str, presets: Mapping[str, Preset] | None = None,
              limits: Limits = DEFAULT_LIMITS) -> str:
    """The packed payload of a JSON form (``payload``: a dict or a JSON string; see the module docstring).
    Raises :class:`SteeringValidationError` naming the field under ``field``."""
    body = expand_preset(parse_json(payload, field, limits), field, presets or {})
    return pack_decoded(decode_payload(body, field, limits), field)


def check_preset(name: str, preset: Preset, limits: Limits = DEFAULT_LIMITS, field: str | None = None) -> None:
    """Validate ``preset`` with its default parameters against the payload schema (its fit to the model is
    checked where a frontend registers it). Raises :class:`SteeringValidationError` naming the field under
    ``field`` (default ``presets.<name>``, as in the config)."""
    pack_json({"preset": name}, field or f"presets.{name}", {name: preset}, limits)
