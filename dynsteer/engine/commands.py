"""Engine core: the command desk of the async tier (``dynsteer.commands``).

Monitors send commands to a ROUTER socket the engine core binds (``MonitorConfig.command_endpoint``). The scheduler
drains it at the start of each ``schedule()`` (never waiting), validates each command against the model and the
request it names exactly as the workers will compile it, and takes it at that step:

* the command rides that step's scheduler output (:data:`COMMANDS_ATTR`), so every worker and TP rank applies it
  before the step's forward; the ack names the step (:data:`STEP_ATTR` numbers steps for workers and frames);
* the scheduler's mirror of the table rows is updated (a command that needs a row when none is free is rejected);
* a command changing what a request's generated tokens compute is folded into the hash of its blocks from the
  first position the step computes (``engine.apc``): block hashes not yet cached from there on are recomputed, so
  KV computed under the command is never served to a request that would compute it differently;
* ``abort`` finishes the request at the next output with a reason naming the monitor.

The desk mirrors what commands are validated against in a :class:`~dynsteer.engine.apc.FrontendState` (admission's
own state): named vectors and the global spec/policy, kept current by watching the engine core's ``collective_rpc``;
probes and limits from the config.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from dynsteer.commands import (Ack, AbortCommand, CommandEnvelope, GlobalCommand, SteerCommand, check_steer,
                               decode_command, patch_policy)
from dynsteer.config import DynsteerConfig
from dynsteer.engine.apc import build_frontend_state, command_event, global_change_event
from dynsteer.payload import PAYLOAD_KEY, decode_payload
from dynsteer.policy import admit_policy
from dynsteer.spec import SteeringSpec, SteeringValidationError
from dynsteer.steering.compile import compile_phase
from dynsteer.streams.security import bind

logger = logging.getLogger("dynsteer")

COMMANDS_ATTR = "dynsteer_commands"
"""Attribute of a ``SchedulerOutput``: the commands every worker applies before that step's forward (JSON dicts:
``{"monitor": name, "command": {...}}``)."""
STEP_ATTR = "dynsteer_step"
"""Attribute of a ``SchedulerOutput``: the engine core's step number (acks and stream frames name it)."""


@dataclass
class _Overrides:
    """What commands changed for one live request (the next command is validated on top of it)."""

    spec: SteeringSpec | None = None  # the current ``steer`` command's spec
    policy: Any = None  # the request's policy with thresholds/rules patched (None: as admitted)


@dataclass
class DeskStats:
    received: int = 0
    applied: int = 0
    rejected: int = 0


class CommandDesk:
    """The engine core's end of the command channel (one per scheduler)."""

    def __init__(self, cfg: DynsteerConfig, vllm_config: Any) -> None:
        assert cfg.monitor is not None
        self.cfg = cfg.monitor
        self.state = build_frontend_state(vllm_config)
        self.overrides: dict[str, _Overrides] = {}
        self.stats = DeskStats()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.RCVHWM, 4 * self.cfg.max_commands_per_step)
        self._binding = bind(self.sock, self.cfg.command_endpoint, self.cfg.curve)

    # ---- mirror of the workers' state (collective_rpc) -------------------------------------------------------
    def observe(self, method: str, args: tuple) -> None:
        """Called after a successful ``collective_rpc`` in the engine core: keep named vectors and globals current."""
        from dynsteer.vectors import unpack_vector

        state = self.state
        if method == "dynsteer_register_vector":
            state.register(args[0], unpack_vector(args[1]))
        elif method == "dynsteer_unregister_vector":
            state.named.pop(args[0], None)
            state.version += 1
        elif method == "dynsteer_set_global":
            decoded = decode_payload(args[0], field="global", limits=state.limits)
            state.set_global(decoded.spec, state.check_global(decoded.spec, decoded.policy))

    # ---- one step ---------------------------------------------------------------------------------------------
    def take(self, scheduler: Any, step: int) -> list[dict[str, Any]]:
        """Drain waiting commands (at most ``max_commands_per_step``), apply their engine-core side and return what
        the workers must apply at ``step``. Never blocks; a bad message is answered and dropped."""
        out: list[dict[str, Any]] = []
        if len(self.overrides) > 2 * len(scheduler.requests) + 64:
            self.overrides = {r: o for r, o in self.overrides.items() if r in scheduler.requests}
        for _ in range(self.cfg.max_commands_per_step):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) != 2:
                continue  # not a DEALER's single-frame message: nothing to answer to reliably
            ident, raw = frames[0].bytes, frames[1].buffer
            self.stats.received += 1
            cid = ""
            try:
                env = decode_command(raw, max_bytes=self.state.limits.max_payload_bytes + 4096)
                cid = env.id
                wire = self._apply(scheduler, env)
            except SteeringValidationError as exc:
                self._answer(ident, Ack(id=cid or _id_of(raw), status="rejected", error=str(exc)))
                self.stats.rejected += 1
                continue
            except Exception as exc:  # noqa: BLE001 - a command never takes the engine down
                logger.exception("dynsteer: command failed in the engine core")
                self._answer(ident, Ack(id=cid or _id_of(raw), status="rejected",
                                        error=f"command: internal error ({exc!r})"))
                self.stats.rejected += 1
                continue
            if wire is not None:
                out.append(wire)
            self.stats.applied += 1
            self._answer(ident, Ack(id=env.id, status="applied", step=step))
        return out

    def _apply(self, scheduler: Any, env: CommandEnvelope) -> dict[str, Any] | None:
        cmd = env.command
        if isinstance(cmd, GlobalCommand):
            return self._apply_global(scheduler, env, cmd)
        request = scheduler.requests.get(cmd.request)
        if request is None or request.is_finished():
            raise SteeringValidationError(f"command.request: no live request {cmd.request!r}")
        if isinstance(cmd, AbortCommand):
            reason = f"dynsteer monitor {env.monitor}: {cmd.reason or 'aborted'}"
            scheduler._dynsteer.aborts[cmd.request] = reason
            return None  # the scheduler finishes it; the workers learn it as a finished request
        ov = self.overrides.get(cmd.request) or _Overrides()
        base_spec, base_policy = self._request_config(request)
        spec, policy = ov.spec, ov.policy
        if isinstance(cmd, SteerCommand):
            check_steer(cmd.spec)
            spec = None if cmd.spec is None or cmd.spec.is_empty() else cmd.spec
        else:
            policy = patch_policy(policy if policy is not None else base_policy, cmd)
        effective = policy if policy is not None else base_policy
        state = self.state
        specs = [("global.", state.global_spec)]
        if base_spec is not None and not base_spec.is_empty():
            specs.append((f"extra_args.{PAYLOAD_KEY}.spec.", base_spec))
        if spec is not None:
            specs.append(("command.spec.", spec))
        pol = None if effective is None or not (effective.rules or effective.controller) else ("command.policy.",
                                                                                               effective)
        decode = compile_phase(specs, "decode", state.shape, state.named, pol).digest.hex()
        from dynsteer.engine.scheduler import swap_decode_row  # the scheduler module imports this one

        swap_decode_row(scheduler, request, decode)  # raises naming the field when no row is free
        self.overrides[cmd.request] = _Overrides(spec, policy)
        command_event(request, f"{env.monitor}:{decode}", scheduler._dynsteer.hash_block_size)
        scheduler._dynsteer.hold(request.request_id)
        return {"monitor": env.monitor, "command": cmd.model_dump(mode="json")}

    def _apply_global(self, scheduler: Any, env: CommandEnvelope, cmd: GlobalCommand) -> dict[str, Any]:
        """Validate a global change as the workers will compile it, update the mirror, fork live requests' hashes
        and salt requests admitted from now on (the frontend, which salts by the global it knows, does not see it)."""
        spec = cmd.spec if cmd.spec is not None else SteeringSpec()
        admitted = self.state.check_global(spec, cmd.policy)  # raises naming the field
        self.state.set_global(spec, admitted)
        state = scheduler._dynsteer
        signature = _signature(f"{env.monitor}|{cmd.model_dump_json()}")
        _fork_live_requests(scheduler, signature, state.hash_block_size)
        state.global_salt = "" if spec.is_empty() and cmd.policy is None else signature
        return {"monitor": env.monitor, "command": cmd.model_dump(mode="json")}

    def _request_config(self, request: Any) -> tuple[SteeringSpec | None, Any]:
        """The request's own spec and its effective dynamic policy as admitted."""
        extra = (request.sampling_params and request.sampling_params.extra_args) or {}
        payload = extra.get(PAYLOAD_KEY)
        spec = policy = None
        state = self.state
        if payload is not None:
            decoded = decode_payload(payload, limits=state.limits)
            spec = decoded.spec
            if decoded.policy is not None:
                policy = admit_policy(decoded.policy, state.probes, state.controllers,
                                      f"extra_args.{PAYLOAD_KEY}.policy.")
        return spec, policy if policy is not None else state.global_policy

    def _answer(self, ident: bytes, ack: Ack) -> None:
        try:
            self.sock.send_multipart([ident, msgspec.msgpack.encode(ack.model_dump())], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            pass  # the monitor is gone or not reading: the command's effect stands; nothing to wait for

    def close(self) -> None:
        self.sock.close(0)
        self._binding.close()


def _id_of(raw: Any) -> str:
    """The ``id`` of a message that failed validation, if one can be read (so the ack can be matched)."""
    try:
        obj = msgspec.msgpack.decode(raw)
        cid = obj.get("id") if isinstance(obj, dict) else None
        return cid if isinstance(cid, str) and 0 < len(cid) <= 128 else ""
    except Exception:  # noqa: BLE001
        return ""


def _signature(text: str) -> str:
    """A global change's id in block hashes (the same on every process)."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _fork_live_requests(scheduler: Any, signature: str, hash_block_size: int) -> None:
    """The global spec or policy changed on the workers: fork the prefix-cache hashes of every live request from
    its first uncomputed position (see ``apc.global_change_event``)."""
    for request in list(scheduler.requests.values()):
        if not request.is_finished():
            global_change_event(request, signature, hash_block_size)
            scheduler._dynsteer.hold(request.request_id)


def patch_engine_core(cls: type) -> None:
    """Keep the command desk's mirror current (it watches the control RPCs that change what commands compile to),
    and fork live requests' prefix-cache hashes when the global steering changes under them."""
    if "_dynsteer_patched" in cls.__dict__:
        return
    orig = cls.collective_rpc

    @functools.wraps(orig)
    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> Any:
        out = orig(self, method, timeout, args, kwargs)
        state = getattr(getattr(self, "scheduler", None), "_dynsteer", None)
        if method == "dynsteer_set_global" and state is not None:
            _fork_live_requests(self.scheduler, _signature(repr(args)), state.hash_block_size)
            state.global_salt = ""  # the frontend knows this global again and salts by it
        desk = getattr(state, "desk", None)
        if desk is not None and isinstance(method, str) and method.startswith("dynsteer_"):
            try:
                desk.observe(method, tuple(args))
            except Exception:  # noqa: BLE001 - the workers accepted it; a mirror miss only makes commands stricter
                logger.exception("dynsteer: the command desk could not mirror %s", method)
        return out

    cls.collective_rpc = collective_rpc
    cls._dynsteer_patched = True
