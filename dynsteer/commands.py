"""Commands external monitor services send back to the engine (the async tier, DESIGN §4), and their acks.

A command travels as one msgpack map over the engine core's command socket (``MonitorConfig.command_endpoint``)::

    {"id": "c-17", "monitor": "toxicity", "command": {"op": "steer", "request": "<request id>", "spec": {...}}}

The engine core validates it (schema, then against the model and the request it names), takes it at one scheduler
step and sends it to every worker with that step's scheduler output, so every tensor-parallel rank applies it at the
same step; the ack names that step::

    {"id": "c-17", "status": "applied", "step": 412}
    {"id": "c-18", "status": "rejected", "error": "command.spec.vectors[0].vector: unknown vector 'x'"}

Commands change what a request computes from the acked step on; they never touch tokens computed before it.
Request ids are the engine's ids, as stream frames name them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, TypeAdapter, ValidationError,
                      field_validator)

from dynsteer.policy import DynamicSteeringPolicy
from dynsteer.spec import Real, SteeringSpec, SteeringValidationError

COMMAND_VERSION = 1
MAX_COMMAND_BYTES = 8 << 20  # a command may carry inline vectors; bounded further by Limits.max_payload_bytes

RequestId = Annotated[str, Field(min_length=1, max_length=256)]


class _Cmd(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


class AbortCommand(_Cmd):
    """Finish ``request`` now (``finish_reason="abort"``, ``stop_reason`` naming the monitor and ``reason``)."""

    op: Literal["abort"] = "abort"
    request: RequestId
    reason: str = Field(default="", max_length=512)


class SteerCommand(_Cmd):
    """Set (or with ``spec=None`` clear) steering added to ``request``'s generated tokens from the acked step on.

    It adds to what the request already has (its own payload and the global spec); a later ``steer`` replaces the
    earlier one. Only the ``base`` and ``decode`` tiers: prompt tokens are not recomputed.
    """

    op: Literal["steer"] = "steer"
    request: RequestId
    spec: Optional[SteeringSpec] = None


class ThresholdCommand(_Cmd):
    """Move the threshold of monitor ``monitor`` in ``request``'s dynamic policy (its controller state is kept)."""

    op: Literal["threshold"] = "threshold"
    request: RequestId
    monitor: str = Field(min_length=1, max_length=128)
    threshold: Real

    @field_validator("threshold")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"must be finite, got {v}")
        return v


class RuleCommand(_Cmd):
    """Switch rule ``rule`` (its index) of ``request``'s dynamic policy off or on again (its gate keeps being
    computed; only its actions stop or resume)."""

    op: Literal["rule"] = "rule"
    request: RequestId
    rule: StrictInt = Field(ge=0, le=63)
    enabled: StrictBool


class GlobalCommand(_Cmd):
    """Replace the engine's global steering (like ``Steerer.apply_steering_spec`` + ``set_policy``): ``spec`` for
    every request (``None``: none) and ``policy`` for every request without its own (``None``: none), from the acked
    step on, for live requests too. Live requests' prefix-cache hashes fork from their next position, and requests
    admitted afterwards share cached blocks only with each other. The frontend's ``export_steering_spec`` /
    ``export_policy`` do not see a monitor's global change (the next change through the API replaces it)."""

    op: Literal["global"] = "global"
    spec: Optional[SteeringSpec] = None
    policy: Optional[DynamicSteeringPolicy] = None


Command = Annotated[Union[AbortCommand, SteerCommand, ThresholdCommand, RuleCommand, GlobalCommand],
                    Field(discriminator="op")]


class CommandEnvelope(_Cmd):
    """One command message: a client-chosen ``id`` (echoed in the ack) and the sending ``monitor``'s name."""

    v: Literal[1] = COMMAND_VERSION
    id: str = Field(min_length=1, max_length=128)
    monitor: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    command: Command


class Ack(BaseModel):
    """The engine's answer to one command."""

    model_config = ConfigDict(extra="forbid")

    id: str
    status: Literal["applied", "rejected"]
    step: Optional[int] = None
    error: Optional[str] = None


_ENVELOPE = TypeAdapter(CommandEnvelope)
COMMAND_ADAPTER: TypeAdapter = TypeAdapter(Command)
_OPS = {"abort", "steer", "threshold", "rule"}


def decode_command(raw: bytes | memoryview, max_bytes: int = MAX_COMMAND_BYTES) -> CommandEnvelope:
    """Decode and schema-validate one command message.

    Raises:
        SteeringValidationError: naming the bad field (``command.request``, ``command.spec.vectors[0].scale``...),
            or the message itself when it is oversize or not a msgpack map.
    """
    if len(raw) > max_bytes:
        raise SteeringValidationError(f"message: {len(raw)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError) as exc:
        raise SteeringValidationError(f"message: not a msgpack map ({exc})") from None
    return parse_command(obj)


def parse_command(obj: Any) -> CommandEnvelope:
    """Validate an already decoded command message (see :func:`decode_command`)."""
    if not isinstance(obj, dict):
        raise SteeringValidationError(f"message: expected a map, got {type(obj).__name__}")
    try:
        return _ENVELOPE.validate_python(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [p for p in err["loc"] if isinstance(p, int) or (isinstance(p, str) and p.isidentifier())]
        if len(loc) > 1 and loc[0] == "command" and loc[1] in _OPS:
            del loc[1]  # pydantic names the union branch (the op) in the location: not a field
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "message"
        msg = str(err["msg"])
        msg = msg[len("Value error, "):] if msg.startswith("Value error, ") else msg
        raise SteeringValidationError(f"{where}: {msg}") from None
    except (RecursionError, TypeError, ValueError) as exc:
        raise SteeringValidationError(f"message: cannot be validated ({exc!r})") from None


def encode_command(envelope: CommandEnvelope) -> bytes:
    """The wire form of a command (inline vectors as packed base64, like request payloads)."""
    return msgspec.msgpack.encode(envelope.model_dump(mode="json"))


def patch_policy(policy: Any, command: ThresholdCommand | RuleCommand) -> Any:
    """``policy`` (admitted: monitors resolved) with the command's threshold or rule switch applied.

    Raises:
        SteeringValidationError: ``command.monitor`` / ``command.rule`` when the policy has no such monitor or rule.
    """
    if policy is None:
        raise SteeringValidationError("command.request: the request has no dynamic policy")
    if isinstance(command, ThresholdCommand):
        names = [m.name for m in policy.monitors]
        if command.monitor not in names:
            raise SteeringValidationError(f"command.monitor: unknown monitor {command.monitor!r} (the request's "
                                          f"policy has {', '.join(map(repr, names)) or 'none'})")
        monitors = tuple(m.model_copy(update={"threshold": float(command.threshold)}) if m.name == command.monitor
                         else m for m in policy.monitors)
        return policy.model_copy(update={"monitors": monitors})
    if command.rule >= len(policy.rules):
        raise SteeringValidationError(f"command.rule: index {command.rule} out of range (the request's policy has "
                                      f"{len(policy.rules)} rules)")
    rules = tuple(r.model_copy(update={"enabled": command.enabled}) if i == command.rule else r
                  for i, r in enumerate(policy.rules))
    return policy.model_copy(update={"rules": rules})


def check_steer(spec: SteeringSpec | None) -> None:
    """Commands steer generated tokens only: refuse ``prefill``-tier entries (naming the field)."""
    if spec is None:
        return
    for group in ("vectors", "clamps", "ablations"):
        for i, entry in enumerate(getattr(spec, group)):
            if entry.tier == "prefill":
                raise SteeringValidationError(f"command.spec.{group}[{i}].tier: commands steer generated tokens "
                                              f"only ('base' or 'decode'); prompt tokens are not recomputed")
