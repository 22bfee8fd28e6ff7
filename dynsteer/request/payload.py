"""The per-request steering payload carried in ``SamplingParams.extra_args["dynsteer"]``.

One compact string: ``ds1:`` + base64 of msgpack (vectors as raw float32 bytes), then ``~`` + the request's tag if it
has one. A single string survives every hop (frontend → engine core msgpack, engine core → worker pickle, and the
OpenAI server's flat ``vllm_xargs``). The tag stays outside the packed body so that requests sharing a configuration
share one body: admission and the workers memoise their work per body, not per request. A JSON object
``{"spec": {...}, "tag": ...}`` (vectors as names or ``{"b64": ...}``) is accepted too, for hand-written requests.
"""

from __future__ import annotations

import base64
import dataclasses
import binascii
import hashlib
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

import msgspec
import numpy as np
from pydantic import ValidationError

from dynsteer.capture.spec import CaptureSpec
from dynsteer.config import DEFAULT_LIMITS, Limits, check_shape
from dynsteer.memo import BoundedMemo, body_digest
from dynsteer.policy import DynamicSteeringPolicy
from dynsteer.spec import SteeringSpec, SteeringValidationError, error_text, field_path

PAYLOAD_KEY = "dynsteer"
_PREFIX = "ds1:"
_TAG_SEP = "~"  # not in the base64 alphabet
#: what a request may ask to get back about its steering (``RequestPayload.report``)
ReportKind = Literal["summary", "tokens"]


@dataclass(frozen=True)
class RequestPayload:
    """A decoded payload: the request's static spec, optional capture spec and dynamic policy, a correlation tag."""

    spec: SteeringSpec
    tag: str | None = None
    capture: CaptureSpec | None = None
    policy: DynamicSteeringPolicy | None = None
    trace: bool = False  # keep the dynamic-steering trace for the caller to take (Steerer does; HTTP clients need not)
    # return what steering did with the outputs: "summary" (per request) or "tokens" (per generated token too)
    report: ReportKind | None = None


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return np.ascontiguousarray(obj, dtype="<f4").tobytes()
    raise NotImplementedError(type(obj).__name__)


def encode_payload(spec: SteeringSpec | None = None, tag: str | None = None,
                   capture: CaptureSpec | None = None, policy: DynamicSteeringPolicy | None = None,
                   trace: bool = False, report: ReportKind | None = None, allow_files: bool = True) -> str:
    """Pack a spec, optional capture spec and policy, and a tag into the string stored under ``extra_args["dynsteer"]``.

    A policy's probe-file monitors are loaded here (an engine never reads a file a request names: a server packing
    what a client sent passes ``allow_files=False``, and a probe-file monitor is an error naming it); monitors
    naming a registered probe stay names. ``trace``: ask the engine to keep the request's dynamic-steering trace
    until it is taken (:meth:`dynsteer.Steerer.take_traces`). ``report``: return what steering did with the outputs
    (``"summary"`` or ``"tokens"``; see :mod:`dynsteer.trace`).
    """
    body: dict[str, Any] = {"spec": (spec or SteeringSpec()).model_dump(mode="python")}
    if capture is not None:
        body["capture"] = capture.model_dump(mode="python")
    if policy is not None:
        body["policy"] = policy.resolved(allow_files=allow_files).model_dump(mode="python", exclude_none=True)
    if trace:
        body["trace"] = True
    if report is not None:
        body["report"] = _check_report(report, "report")
    packed = _PREFIX + base64.b64encode(msgspec.msgpack.encode(body, enc_hook=_enc_hook)).decode("ascii")
    return with_tag(packed, tag)


def pack_decoded(decoded: RequestPayload, field: str = f"extra_args.{PAYLOAD_KEY}") -> str:
    """The packed form of a payload decoded from a client's JSON (:func:`decode_payload`'s object path): every
    field of :class:`RequestPayload` is passed on to :func:`encode_payload` by name, so the packed body is the one
    the Python API builds for the same configuration (and shares its memo entries). Files are never read."""
    try:
        return encode_payload(**{f.name: getattr(decoded, f.name) for f in dataclasses.fields(decoded)},
                              allow_files=False)
    except SteeringValidationError as exc:
        raise SteeringValidationError(f"{field}.policy.{exc}") from None  # the only check that raises here


def config_fingerprint(spec: SteeringSpec, policy: DynamicSteeringPolicy | None = None) -> bytes:
    """Content identity of a spec and policy: equal configurations give equal bytes. Memo keys use it, so a global
    configuration that is set and cleared again (``with steerer.steering(...)``) finds its admissions still cached."""
    body = {"spec": spec.model_dump(mode="python"),
            "policy": None if policy is None else policy.model_dump(mode="python", exclude_none=True)}
    return hashlib.blake2b(msgspec.msgpack.encode(body, enc_hook=_enc_hook), digest_size=16).digest()


def with_tag(payload: str, tag: str | None) -> str:
    """``payload`` (packed) carrying ``tag`` instead of its own (the body, and so every memo keyed by it, is shared)."""
    body = payload_body(payload)
    return body if tag is None else f"{body}{_TAG_SEP}{tag}"


def payload_body(payload: Any) -> Any:
    """The packed body of a payload without its tag: the memoisation key of what it configures."""
    return payload.split(_TAG_SEP, 1)[0] if isinstance(payload, str) else payload


def decode_payload(obj: Any, field: str = f"extra_args.{PAYLOAD_KEY}",
                   limits: Limits = DEFAULT_LIMITS, digest: bytes | None = None) -> RequestPayload:
    """Decode and schema-validate a payload within ``limits``; raises :class:`SteeringValidationError` naming the
    bad field (the payload itself when it is oversize, too deep or has too many entries). ``digest``: the
    caller's ``body_digest(payload_body(obj))`` of a packed payload, if it has it (not computed twice)."""
    if isinstance(obj, str):
        packed, tag = check_envelope(obj, field, limits)
        decoded = _decode_packed(packed, field, limits, digest)
        if tag is None:
            return decoded
        return RequestPayload(decoded.spec, tag, decoded.capture, decoded.policy, decoded.trace, decoded.report)
    if not isinstance(obj, dict):
        raise SteeringValidationError(f"{field}: expected a packed string or an object, got {type(obj).__name__}")
    try:
        size = len(msgspec.msgpack.encode(obj, enc_hook=_enc_hook))
    except (TypeError, NotImplementedError, RecursionError, OverflowError, ValueError) as exc:
        raise SteeringValidationError(f"{field}: the payload object cannot be encoded ({exc!r})") from None
    if size > limits.max_payload_bytes:
        raise SteeringValidationError(f"{field}: payload of {size} bytes exceeds the engine's limit "
                                      f"max_payload_bytes = {limits.max_payload_bytes}")
    return _decode_body(obj, field, limits)


def check_envelope(payload: str, field: str = f"extra_args.{PAYLOAD_KEY}",
                   limits: Limits = DEFAULT_LIMITS) -> tuple[str, str | None]:
    """A packed payload's body and tag, checked on every use, memo hits included: its size within
    ``limits.max_payload_bytes``, its tag (if any) a safe name (it names capture files)."""
    packed, _, tag = payload.partition(_TAG_SEP)
    if len(payload) > limits.max_payload_bytes:
        raise SteeringValidationError(f"{field}: payload of {len(payload)} bytes exceeds the engine's limit "
                                      f"max_payload_bytes = {limits.max_payload_bytes}")
    return packed, (_check_tag(tag, field) if tag else None)


# Decoded bodies by (digest of the body, field, limits): a batch usually repeats a few configurations, and
# validating vectors is the costly part. Bounded by what the decoded objects keep resident (dynsteer.memo).
_memo: BoundedMemo[RequestPayload] = BoundedMemo(DEFAULT_LIMITS.cache_bytes)


def _decode_packed(packed: str, field: str, limits: Limits, digest: bytes | None = None) -> RequestPayload:
    key = (body_digest(packed) if digest is None else digest, field, limits)
    hit = _memo.get(key)
    if hit is not None:
        return hit
    if not packed.startswith(_PREFIX):
        raise SteeringValidationError(f"{field}: packed payload must start with {_PREFIX!r}")
    try:
        body = msgspec.msgpack.decode(base64.b64decode(packed[len(_PREFIX):], validate=True))
    except (binascii.Error, msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise SteeringValidationError(f"{field}: malformed packed payload ({type(exc).__name__}: {exc})") from None
    decoded = _decode_body(body, field, limits)
    _memo.resize(limits.cache_bytes)  # one engine configuration per process
    _memo.put(key, decoded)
    return decoded


def _check_tag(tag: Any, field: str) -> str:
    from dynsteer.capture.names import check_tag  # the one rule for what may name capture files

    return check_tag(tag, f"{field}.tag")


def _decode_body(body: Any, field: str, limits: Limits = DEFAULT_LIMITS) -> RequestPayload:
    if not isinstance(body, dict) or set(body) - {"spec", "tag", "capture", "policy", "trace", "report"}:
        raise SteeringValidationError(
            f"{field}: payload must be an object with keys 'spec', 'capture', 'policy', 'trace', 'report' and 'tag' "
            f"(all optional)")
    check_shape(body, field, limits)
    parsed: dict[str, Any] = {}
    for key, model in (("spec", SteeringSpec), ("capture", CaptureSpec), ("policy", DynamicSteeringPolicy)):
        if body.get(key) is None:
            continue
        try:
            parsed[key] = model.model_validate(body[key])
        except ValidationError as exc:
            err = exc.errors()[0]
            parts = [key, *err["loc"]]
            loc = field_path(parts)
            if err["type"] == "extra_forbidden":  # the client's own key: shown, made harmless
                loc = field_path(parts[:-1]) + "." + (re.sub(r"[^A-Za-z0-9_-]", "?", str(parts[-1]))[:40] or "?")
            raise SteeringValidationError(f"{field}.{loc}: {error_text(err)}") from None
        except RecursionError:
            raise SteeringValidationError(f"{field}.{key}: nested too deeply") from None
    tag, trace = body.get("tag"), body.get("trace", False)
    if not isinstance(trace, bool):
        raise SteeringValidationError(f"{field}.trace: must be true or false")
    report = body.get("report")
    return RequestPayload(spec=parsed.get("spec", SteeringSpec()),
                          tag=None if tag is None else _check_tag(tag, field), capture=parsed.get("capture"),
                          policy=parsed.get("policy"), trace=trace,
                          report=None if report is None else _check_report(report, f"{field}.report"))


def _check_report(report: Any, field: str) -> ReportKind:
    if report not in get_args(ReportKind):
        raise SteeringValidationError(f"{field}: must be one of {', '.join(map(repr, get_args(ReportKind)))} or "
                                      f"null")
    return report
