"""The per-request steering payload carried in ``SamplingParams.extra_args["dynsteer"]``.

One compact string: ``ds1:`` + base64 of msgpack (vectors as raw float32 bytes), then ``~`` + the request's tag if it
has one. A single string survives every hop (frontend → engine core msgpack, engine core → worker pickle, and the
OpenAI server's flat ``vllm_xargs``). The tag stays outside the packed body so that requests sharing a configuration
share one body: admission and the workers memoise their work per body, not per request. A JSON object
``{"spec": {...}, "tag": ...}`` (vectors as names or ``{"b64": ...}``) is accepted too, for hand-written requests.
"""

from __future__ import annotations

import base64
import binascii
import functools
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from pydantic import ValidationError

from dynsteer.capture.spec import CaptureSpec
from dynsteer.policy import DynamicSteeringPolicy
from dynsteer.spec import SteeringSpec, SteeringValidationError

PAYLOAD_KEY = "dynsteer"
_PREFIX = "ds1:"
_TAG_SEP = "~"  # not in the base64 alphabet


@dataclass(frozen=True)
class RequestPayload:
    """A decoded payload: the request's static spec, optional capture spec and dynamic policy, a correlation tag."""

    spec: SteeringSpec
    tag: str | None = None
    capture: CaptureSpec | None = None
    policy: DynamicSteeringPolicy | None = None


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return np.ascontiguousarray(obj, dtype="<f4").tobytes()
    raise NotImplementedError(type(obj).__name__)


def encode_payload(spec: SteeringSpec | None = None, tag: str | None = None,
                   capture: CaptureSpec | None = None, policy: DynamicSteeringPolicy | None = None) -> str:
    """Pack a spec, optional capture spec and policy, and a tag into the string stored under ``extra_args["dynsteer"]``.

    A policy's probe-file monitors are loaded here (the workers may not see the file).
    """
    body: dict[str, Any] = {"spec": (spec or SteeringSpec()).model_dump(mode="python")}
    if capture is not None:
        body["capture"] = capture.model_dump(mode="python")
    if policy is not None:
        body["policy"] = policy.resolved().model_dump(mode="python", exclude_none=True)
    packed = _PREFIX + base64.b64encode(msgspec.msgpack.encode(body, enc_hook=_enc_hook)).decode("ascii")
    return with_tag(packed, tag)


def with_tag(payload: str, tag: str | None) -> str:
    """``payload`` (packed) carrying ``tag`` instead of its own (the body, and so every memo keyed by it, is shared)."""
    body = payload_body(payload)
    return body if tag is None else f"{body}{_TAG_SEP}{tag}"


def payload_body(payload: Any) -> Any:
    """The packed body of a payload without its tag: the memoisation key of what it configures."""
    return payload.split(_TAG_SEP, 1)[0] if isinstance(payload, str) else payload


def decode_payload(obj: Any, field: str = f"extra_args.{PAYLOAD_KEY}") -> RequestPayload:
    """Decode and schema-validate a payload; raises :class:`SteeringValidationError` naming the bad field."""
    if isinstance(obj, str):
        packed, _, tag = obj.partition(_TAG_SEP)
        decoded = _decode_packed(packed, field)
        return decoded if not tag else RequestPayload(decoded.spec, tag, decoded.capture, decoded.policy)
    if not isinstance(obj, dict):
        raise SteeringValidationError(f"{field}: expected a packed string or an object, got {type(obj).__name__}")
    return _decode_body(obj, field)


@functools.lru_cache(maxsize=512)
def _decode_packed(packed: str, field: str) -> RequestPayload:
    # Memoised: a batch usually repeats a few configurations, and validating vectors is the costly part.
    if not packed.startswith(_PREFIX):
        raise SteeringValidationError(f"{field}: packed payload must start with {_PREFIX!r}")
    try:
        body = msgspec.msgpack.decode(base64.b64decode(packed[len(_PREFIX):], validate=True))
    except (binascii.Error, msgspec.DecodeError, ValueError) as exc:
        raise SteeringValidationError(f"{field}: malformed packed payload ({exc})") from None
    return _decode_body(body, field)


def _decode_body(body: Any, field: str) -> RequestPayload:
    if not isinstance(body, dict) or set(body) - {"spec", "tag", "capture", "policy"}:
        raise SteeringValidationError(
            f"{field}: payload must be an object with keys 'spec', 'capture', 'policy' and 'tag' (all optional)")
    parsed: dict[str, Any] = {}
    for key, model in (("spec", SteeringSpec), ("capture", CaptureSpec), ("policy", DynamicSteeringPolicy)):
        if body.get(key) is None:
            continue
        try:
            parsed[key] = model.model_validate(body[key])
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise SteeringValidationError(f"{field}.{key}.{loc}: {err['msg']}") from None
    tag = body.get("tag")
    if tag is not None and not isinstance(tag, str):
        raise SteeringValidationError(f"{field}.tag: must be a string")
    return RequestPayload(spec=parsed.get("spec", SteeringSpec()), tag=tag, capture=parsed.get("capture"),
                          policy=parsed.get("policy"))
