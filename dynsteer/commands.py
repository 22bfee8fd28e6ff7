"""Commands external monitor services send back to the engine (the async tier, architecture §4), and their acks.

A command travels as one msgpack map over the engine core's command socket (``MonitorConfig.command_endpoint``)::

    {"id": "c-17", "monitor": "toxicity", "command": {"op": "steer", "request": "<request id>", "spec": {...}}}

The engine core validates it (schema, then against the model and the request it names), takes it at one scheduler
step and sends it to every worker with that step's scheduler output, so every tensor-parallel rank applies it at the
same step; the ack names that step::

    {"id": "c-17", "status": "applied", "step": 412}
    {"id": "c-18", "status": "rejected", "error": "command.spec.vectors[0].vector: unknown vector 'x'"}

Commands change what a request computes from the acked step on; they never touch tokens computed before it.
A command's ``request`` is the engine's id, as stream frames name it (``StreamFrame.req_ids``: vLLM's id with its
``-`` and 8 hex characters), or the id the user gave vLLM and its outputs show (``StreamFrame.user_ids``,
:func:`user_request_id`) when exactly one live request has it; the ack names the engine id it was applied to.

Who may send what is the engine core's business (``dynsteer.engine.command_desk``): ``monitor`` is checked against the
connection's CURVE key when there is one, and ``op`` against ``MonitorConfig.grants``, before the command is
validated. A message holds at most ``Limits.max_payload_bytes + COMMAND_ENVELOPE_BYTES`` bytes and its ``command``
map the payload shape limits (:func:`check_command_shape`).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Optional, Union, get_args

import msgspec
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError,
                      field_validator)

from dynsteer._deprecated import renamed
from dynsteer.config import DEFAULT_LIMITS, CommandOp, Limits, check_shape
from dynsteer.policy import DynamicSteeringPolicy, gate_param_problem
from dynsteer.spec import Real, SteeringSpec, SteeringValidationError, error_text, field_path

COMMAND_VERSION = 1
MAX_COMMAND_BYTES = 8 << 20  # a command may carry inline vectors; bounded further by Limits.max_payload_bytes
COMMAND_ENVELOPE_BYTES = 4096
"""What a command message may hold beyond ``Limits.max_payload_bytes`` (its envelope and the command's own fields):
the engine core's command socket refuses larger messages (``max_message_bytes``)."""

RequestId = Annotated[str, Field(min_length=1, max_length=256)]
# Strict: the name that identity and grants are checked on (read before validation) is the one validated.
MonitorName = Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]


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
        problem = gate_param_problem("threshold", float(v))  # the same bound as an admitted monitor's
        if problem is not None:
            raise ValueError(problem)
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
    monitor: MonitorName
    command: Command


class CommandAck(BaseModel):
    """The engine's answer to one command."""

    model_config = ConfigDict(extra="forbid")

    id: str
    status: Literal["applied", "rejected"]
    step: Optional[int] = None
    error: Optional[str] = None
    request: Optional[str] = None  # applied: the engine id of the request the command named (None for global)


_ENVELOPE = TypeAdapter(CommandEnvelope)
_MONITOR_NAME: TypeAdapter = TypeAdapter(MonitorName)
COMMAND_ADAPTER: TypeAdapter = TypeAdapter(Command)
COMMAND_OPS: frozenset[str] = frozenset(get_args(CommandOp))
_ENVELOPE_KEYS = frozenset(CommandEnvelope.model_fields)


def max_message_bytes(limits: Limits) -> int:
    """The largest command message an engine with ``limits`` takes (its command socket's ``MAXMSGSIZE``)."""
    return limits.max_payload_bytes + COMMAND_ENVELOPE_BYTES


def decode_command(raw: bytes | memoryview, max_bytes: int = MAX_COMMAND_BYTES,
                   limits: Limits | None = DEFAULT_LIMITS) -> CommandEnvelope:
    """Decode and validate one command message: :func:`decode_message`, then :func:`parse_command`.

    Raises:
        SteeringValidationError: naming the bad field (``command.request``, ``command.spec.vectors[0].scale``...),
            or the message itself when it is oversize or not a msgpack map.
    """
    return parse_command(decode_message(raw, max_bytes), limits)


def decode_message(raw: bytes | memoryview, max_bytes: int = MAX_COMMAND_BYTES) -> dict[Any, Any]:
    """The msgpack map of one command message, not validated yet.

    Raises:
        SteeringValidationError: ``message: ...`` when it is over ``max_bytes`` or not a msgpack map.
    """
    if len(raw) > max_bytes:
        raise SteeringValidationError(f"message: {len(raw)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError) as exc:
        raise SteeringValidationError(f"message: not a msgpack map ({exc})") from None
    if not isinstance(obj, dict):
        raise SteeringValidationError(f"message: expected a map, got {type(obj).__name__}")
    return obj


def command_head(obj: dict[Any, Any]) -> tuple[str, str | None]:
    """The sender's monitor name and the command's op, read from a decoded message before it is validated, so that
    identity and grants are checked before any costly work. Returns ``op=None`` when the op is missing or unknown
    (validation then rejects the message). When the message validates, its ``monitor`` and ``command.op`` are
    exactly these (strict strings, no coercion).

    Raises:
        SteeringValidationError: ``message`` (an unknown key), ``monitor`` (missing or not a valid name),
            ``command.op`` (not a string).
    """
    for key in obj:
        if key not in _ENVELOPE_KEYS:
            shown = re.sub(r"[^A-Za-z0-9_-]", "?", str(key))[:40] or "?"
            raise SteeringValidationError(f"message: unknown key {shown!r} (a command message has "
                                          f"{', '.join(sorted(_ENVELOPE_KEYS))})")
    if "monitor" not in obj:
        raise SteeringValidationError("monitor: Field required")
    try:
        monitor = _MONITOR_NAME.validate_python(obj["monitor"])
    except ValidationError as exc:
        raise SteeringValidationError(f"monitor: {exc.errors()[0]['msg']}") from None
    command = obj.get("command")
    op = command.get("op") if isinstance(command, dict) else None
    if op is not None and not isinstance(op, str):
        raise SteeringValidationError(f"command.op: expected a string, got {type(op).__name__}")
    return monitor, op if op in COMMAND_OPS else None


def check_command_shape(command: Any, limits: Limits) -> None:
    """Hold a decoded ``command`` map to a request payload's shape limits (``Limits.max_entries``, ``max_depth``,
    list lengths), before schema validation: a cheap iterative walk, so an oversize ``steer`` or ``global`` is
    refused before anything is built from it. The map counts as a payload's body; the error names ``command.spec``
    or ``command.policy`` when only that field nests."""
    if not isinstance(command, dict):
        return  # validation names it
    nested = [k for k, v in command.items() if isinstance(v, (dict, list, tuple))]
    field = f"command.{nested[0]}" if len(nested) == 1 and nested[0] in ("spec", "policy") else "command"
    check_shape(command, field, limits)


def parse_command(obj: Any, limits: Limits | None = DEFAULT_LIMITS) -> CommandEnvelope:
    """Validate an already decoded command message (see :func:`decode_command`): the envelope's head
    (:func:`command_head`), the command's shape within ``limits`` (``None``: unchecked), then the schema."""
    if not isinstance(obj, dict):
        raise SteeringValidationError(f"message: expected a map, got {type(obj).__name__}")
    command_head(obj)
    if limits is not None:
        check_command_shape(obj.get("command"), limits)
    try:
        return _ENVELOPE.validate_python(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = list(err["loc"])
        if len(loc) > 1 and loc[0] == "command" and loc[1] in COMMAND_OPS:
            del loc[1]  # pydantic names the union branch (the op) in the location: not a field
        raise SteeringValidationError(f"{field_path(loc) or 'message'}: {error_text(err)}") from None
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


_ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z")


def user_request_id(engine_id: str) -> str:
    """The id a request has in vLLM's outputs (``RequestOutput.request_id``: what the user or the OpenAI server
    passed to vLLM) from the id its engine, its stream frames and its commands use.

    vLLM 0.26 makes the engine id unique by appending ``-`` and 8 random hex characters to it (``"32"`` becomes
    ``"32-"`` and those 8); this strips them. The ``n`` samples of one prompt (``SamplingParams.n > 1``) are requests
    ``"{index}_{id}"``, which is what this returns for them. With ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` set in
    the engine, engine ids are the user's and need no mapping.
    """
    return _ENGINE_SUFFIX.sub("", engine_id)


# Old name kept for one release (the stream wire has its own ack, :class:`dynsteer.transport.wire.StreamAck`).
__getattr__ = renamed(__name__, {"Ack": ("CommandAck", CommandAck)})
