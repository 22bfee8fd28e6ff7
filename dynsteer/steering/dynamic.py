"""Dynamic policies on the worker: compile a policy into gate slots, and drive the slots step by step.

A policy's rules each own one *gate slot* (plus one for a controller's monitor when no rule uses it). The decode row
of a request carries, at the monitor's site, the probe that computes the slot's gate, and at each action's site the
gated vector or clamp that reads it (DESIGN §3/§4). The forward writes every slot's score and effective gate into
persistent ``[G, N]`` buffers; what the host adds per token is two multipliers, ``gate = g·mul + add``:

=================  ==========================  ===========================================================
scope              mul, add                    needs the previous step on the host?
=================  ==========================  ===========================================================
``this_token``     ``d, 0``                    only with a controller (``d`` = its scale, else 1)
``next_step``      ``0, d·g(previous token)``  yes
``rest_of_request`` ``d, 0`` → ``0, d`` once fired  yes
=================  ==========================  ===========================================================

So a batch of plain ``this_token`` rules never waits for the device; the sync tier (controllers, carried scopes)
waits for the previous step's scores before planning the next step, which is what makes its latency exactly one step.
Every rank runs this on identical inputs (the same scheduler output and all-reduced residuals), so every rank takes the
same decisions.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dynsteer.spec import ModelShape, SteeringValidationError, resolve_vector
from dynsteer.steering.compile import Clamp, MonitorProgram, SiteKey, SiteProgram

if TYPE_CHECKING:
    from dynsteer.policy import DynamicSteeringPolicy

#: the gate at which ``rest_of_request`` latches (the probe's decision boundary), on top of the rule's floor
FIRE_GATE = 0.5


@dataclass(frozen=True)
class SlotPlan:
    """What one gate slot computes and how its gate is carried across steps."""

    monitor: str
    sharpness: float
    threshold: float
    floor: float
    scope: str  # a rule's scope; "monitor" for a controller-only slot (no actions)


def policy_slots(policy: "DynamicSteeringPolicy") -> tuple[list[SlotPlan], int | None]:
    """The policy's gate slots (rules in order, then the controller's monitor if no rule reads it) and the slot
    feeding the controller (``None`` without one). The policy must be resolved (inline monitors)."""
    slots = []
    for rule in policy.rules:
        m = policy.monitor(rule.monitor)
        slots.append(SlotPlan(m.name, float(m.sharpness), float(m.threshold), rule.gate_floor, rule.scope))
    ctrl_slot = None
    cm = policy.controller_monitor()
    if cm is not None:
        ctrl_slot = next((i for i, s in enumerate(slots) if s.monitor == cm.name), None)
        if ctrl_slot is None:
            slots.append(SlotPlan(cm.name, float(cm.sharpness), float(cm.threshold), 0.0, "monitor"))
            ctrl_slot = len(slots) - 1
    return slots, ctrl_slot


def compile_policy(policy: "DynamicSteeringPolicy", shape: ModelShape, named: dict[str, np.ndarray] | None,
                   prefix: str = "policy.") -> dict[SiteKey, SiteProgram]:
    """The monitors and gated actions a policy puts into a decode row, by site.

    Raises:
        SteeringValidationError: a bad field (named with ``prefix``), or more slots than the engine's ``max_gates``.
    """
    try:
        policy = policy.resolved()
    except (OSError, ValueError) as exc:
        raise SteeringValidationError(f"{prefix}monitors: {exc}") from None
    policy.check(shape, named, prefix)
    slots, _ = policy_slots(policy)
    if len(slots) > shape.max_gates:
        what = "this engine has no dynamic tier" if shape.max_gates == 0 else f"at most {shape.max_gates}"
        raise SteeringValidationError(
            f"{prefix}rules: the policy needs {len(slots)} gate slots (one per rule, plus the controller's monitor "
            f"when no rule reads it); {what} (raise DynsteerConfig.max_gates)")
    sites: dict[SiteKey, SiteProgram] = {}
    for s, slot in enumerate(slots):
        m = policy.monitor(slot.monitor)
        probe = resolve_vector(m.direction, f"{prefix}monitors.{m.name}.direction", shape, None)
        prog = sites.setdefault((m.layer, m.site), SiteProgram())
        prog.monitors[s] = MonitorProgram(probe.astype(np.float32), slot.sharpness, slot.threshold, slot.floor)
    for s, rule in enumerate(policy.rules):
        for j, a in enumerate(rule.actions):
            v = resolve_vector(a.vector, f"{prefix}rules[{s}].actions[{j}].vector", shape, named)
            prog = sites.setdefault((a.layer, a.site), SiteProgram())
            if a.kind == "add":
                v = v * np.float32(a.scale)
                prog.dyn[s] = v if s not in prog.dyn else prog.dyn[s] + v
            else:
                u = v.astype(np.float64)
                u = (u / np.linalg.norm(u)).astype(np.float32)
                lo, hi = (0.0, 0.0) if a.kind == "ablate" else (a.lo, a.hi)
                prog.clamps.append(Clamp(u, -np.inf if lo is None else lo, np.inf if hi is None else hi,
                                         a.strength, gate=s))
    return sites


# ---- per-request state ---------------------------------------------------------------------------------------------
@dataclass
class DynState:
    """One request's dynamic state on a worker: controller state, carried gates and its trace."""

    slots: list[SlotPlan]
    controller: Any = None  # a SyncController, or None
    ctrl_slot: int | None = None
    ctrl_state: Any = None
    scale: float = 1.0  # dyn_scale for the next step
    latched: np.ndarray = None  # type: ignore[assignment]
    prev_gate: np.ndarray = None  # type: ignore[assignment]
    steps: int = 0
    # position -> (mul, add) used for it: a recomputed position (after preemption) is steered exactly as before
    history: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    trace: dict[str, list] = field(default_factory=lambda: {k: [] for k in TRACE_FIELDS})

    @classmethod
    def for_policy(cls, policy: "DynamicSteeringPolicy") -> "DynState":
        from dynsteer.controllers.sync import make_controller

        slots, ctrl_slot = policy_slots(policy)
        ctrl = make_controller(policy.controller) if policy.controller is not None else None
        g = len(slots)
        return cls(slots=slots, controller=ctrl, ctrl_slot=ctrl_slot,
                   ctrl_state=ctrl.initial_state() if ctrl is not None else None,
                   scale=0.0 if ctrl is not None else 1.0, latched=np.zeros(g, bool), prev_gate=np.zeros(g))

    @property
    def needs_feedback(self) -> bool:
        """Whether planning the next step needs this step's scores on the host (the sync tier)."""
        return self.controller is not None or any(s.scope in ("next_step", "rest_of_request") for s in self.slots)

    def multipliers(self) -> tuple[np.ndarray, np.ndarray]:
        """``(mul, add)`` per slot for the request's next decode token."""
        d = self.scale
        mul, add = np.zeros(len(self.slots), np.float32), np.zeros(len(self.slots), np.float32)
        for s, slot in enumerate(self.slots):
            if slot.scope == "next_step":
                add[s] = d * self.prev_gate[s]
            elif slot.scope == "rest_of_request" and self.latched[s]:
                add[s] = d
            else:
                mul[s] = d
        return mul, add

    def observe(self, position: int, scores: np.ndarray, applied: np.ndarray) -> None:
        """Record one computed decode token and advance the carried state and the controller."""
        from dynsteer.controllers.sync import StepObservation

        raw = np.array([_gate(sc, s) for sc, s in zip(scores, self.slots)])
        for k, v in (("position", position), ("score", scores.tolist()), ("gate", raw.tolist()),
                     ("applied", applied.tolist()), ("scale", self.scale)):
            self.trace[k].append(v)
        self.prev_gate = raw
        self.latched |= (raw >= FIRE_GATE) & (raw > 0)
        if self.controller is not None:
            c = self.ctrl_slot
            obs = StepObservation(step=self.steps, position=position, score=float(scores[c]), gate=float(raw[c]))
            self.ctrl_state, self.scale = self.controller.on_step(self.ctrl_state, obs)
            self.scale = float(self.scale)
        self.steps += 1


TRACE_FIELDS = ("position", "score", "gate", "applied", "scale")


def _gate(score: float, slot: SlotPlan) -> float:
    # The kernel's gate in float32 (σ of the same float32 inputs), with the rule's floor.
    z = np.float32(slot.sharpness) * (np.float32(score) - np.float32(slot.threshold))
    g = float(np.float32(1.0) / (np.float32(1.0) + np.exp(-z, dtype=np.float32))) if math.isfinite(z) else float(z > 0)
    return g if g >= slot.floor else 0.0


# ---- the per-step driver ------------------------------------------------------------------------------------------------
@dataclass
class _Pending:
    event: Any
    host: torch.Tensor  # [2G, m]: scores then effective gates of the step's dynamic decode tokens
    tokens: list[tuple[str, int, int]]  # (req_id, column, position)


@dataclass
class SyncStats:
    """Cost of the dynamic tier's host side (milliseconds, summed over steps)."""

    dynamic_steps: int = 0
    sync_steps: int = 0
    wait_ms: float = 0.0  # blocked waiting for the previous step's scores (sync tier only)
    host_ms: float = 0.0  # read-back bookkeeping, controllers, carried scopes, staging
    controller_ms: float = 0.0  # of which: the controllers' on_step and the carried-scope updates
    device_ms: float = 0.0  # CUDA-event time of the per-step control copies (read one step late)


class DynamicDriver:
    """Stages gate multipliers before each forward and reads scores/gates back after it."""

    def __init__(self, gate_mul: torch.Tensor, gate_add: torch.Tensor, scores: torch.Tensor,
                 gates: torch.Tensor) -> None:
        self.gate_mul, self.gate_add, self.scores, self.gates = gate_mul, gate_add, scores, gates
        self.cuda = gates.is_cuda
        g, n = gates.shape
        depth = 4 if self.cuda else 1
        self._ctl = [torch.zeros(2, g, n, dtype=torch.float32, device="cpu", pin_memory=self.cuda)
                     for _ in range(depth)]
        self._ctl_events: list[Any] = [None] * depth
        self._i = 0
        self._side = torch.cuda.Stream(device=gates.device) if self.cuda else None
        self._pending: list[_Pending] = []
        self._step_tokens: list[tuple[str, int, int]] = []
        self._timing: list[tuple[Any, Any]] = []
        self.stats = SyncStats()

    def plan(self, states: dict[str, DynState], tokens: list[tuple[str, int, int]], upto: int) -> None:
        """Stage ``(mul, add)`` for this step's dynamic decode tokens ``(req_id, batch index, position)``.

        Waits for the previous step's read-back first when any live request is in the sync tier.
        """
        if any(st.needs_feedback for st in states.values()):
            t0 = time.perf_counter()
            self.poll(states, block=True)
            t1 = time.perf_counter()
            self.stats.wait_ms += (t1 - t0) * 1e3
            self.stats.sync_steps += 1
        else:
            self.poll(states, block=False)
            t1 = time.perf_counter()
        self._step_tokens = tokens
        if not tokens:
            return
        self.stats.dynamic_steps += 1
        self._i = (self._i + 1) % len(self._ctl)
        if self._ctl_events[self._i] is not None:
            self._ctl_events[self._i].synchronize()
        ctl = self._ctl[self._i].numpy()
        for req_id, t, pos in tokens:
            st = states[req_id]
            kept = st.history.get(pos)
            if kept is None:
                kept = st.history[pos] = st.multipliers()
            g = len(kept[0])
            ctl[0, :g, t], ctl[1, :g, t] = kept
        start = torch.cuda.Event(enable_timing=True) if self.cuda else None
        if start is not None:
            start.record()
        src = self._ctl[self._i]
        for s in range(self.gate_mul.shape[0]):
            self.gate_mul[s, :upto].copy_(src[0, s, :upto], non_blocking=self.cuda)
            self.gate_add[s, :upto].copy_(src[1, s, :upto], non_blocking=self.cuda)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._ctl_events[self._i] = end
            self._timing.append((start, end))
            self._read_timing()
        self.stats.host_ms += (time.perf_counter() - t1) * 1e3

    def after_forward(self) -> None:
        """Gather this step's scores and gates of dynamic tokens and start their copy to host."""
        tokens, self._step_tokens = self._step_tokens, []
        if not tokens:
            return
        cols = torch.tensor([t for _, t, _ in tokens], dtype=torch.int64)
        if self.cuda:
            cols = cols.pin_memory().to(self.gates.device, non_blocking=True)
        both = torch.cat([self.scores, self.gates]).index_select(1, cols)
        if self.cuda:
            done = torch.cuda.Event()
            self._side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side):
                host = torch.empty(both.shape, dtype=both.dtype, device="cpu", pin_memory=True)
                host.copy_(both, non_blocking=True)
                both.record_stream(self._side)
                done.record(self._side)
            self._pending.append(_Pending(done, host, [(r, i, p) for i, (r, _, p) in enumerate(tokens)]))
        else:
            self._pending.append(_Pending(None, both.clone(), [(r, i, p) for i, (r, _, p) in enumerate(tokens)]))

    def poll(self, states: dict[str, DynState], block: bool = False) -> None:
        """Feed completed read-backs to their requests, in step order (``block``: wait for all)."""
        while self._pending:
            pend = self._pending[0]
            if pend.event is not None and not pend.event.query():
                if not block:
                    return
                pend.event.synchronize()
            self._pending.pop(0)
            t0 = time.perf_counter()
            host = pend.host.numpy()
            for req_id, col, pos in pend.tokens:
                st = states.get(req_id)
                if st is None or (st.trace["position"] and pos <= st.trace["position"][-1]):
                    continue  # finished meanwhile, or a recomputed position (already observed)
                g = len(st.slots)
                half = host.shape[0] // 2
                st.observe(pos, host[:g, col].astype(np.float64), host[half:half + g, col].astype(np.float64))
            self.stats.controller_ms += (time.perf_counter() - t0) * 1e3

    def _read_timing(self) -> None:
        # One step late: only events that already completed are read, so timing never blocks.
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.pop(0)
            self.stats.device_ms += start.elapsed_time(end)
