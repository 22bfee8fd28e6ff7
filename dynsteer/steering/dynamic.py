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

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dynsteer.controllers.registry import ControllerFault
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
                   prefix: str = "policy.", budget: Any = None) -> dict[SiteKey, SiteProgram]:
    """The monitors and gated actions a policy puts into a decode row, by site.

    The policy must be resolved (inline monitors; the engine resolves registered probe names at admission, and the
    caller's process reads probe files). ``budget``: the configuration's :class:`MagnitudeBudget`, spent by gated
    vectors at the largest scale the controller can output.

    Raises:
        SteeringValidationError: a bad field (named with ``prefix``), or more slots than the engine's ``max_gates``.
    """
    policy.check(shape, named, prefix)
    unresolved = [i for i, m in enumerate(policy.monitors) if not m.is_inline]
    if unresolved:
        raise SteeringValidationError(f"{prefix}monitors[{unresolved[0]}]: not resolved (a registered probe name "
                                      f"the engine has not resolved)")
    dyn_bound = min(policy.max_output(), shape.max_dyn_scale)
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
                if budget is not None:
                    budget.add(abs(a.scale) * dyn_bound * float(np.max(np.abs(v.astype(np.float64)))),
                               f"{prefix}rules[{s}].actions[{j}].scale")
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
    """One request's dynamic state on a worker: controller state, carried gates and its trace.

    Requests in the sync tier (``feedback``) are observed token by token; the others only keep references to the
    read-back blocks, and their trace is assembled once, when the request finishes (off the per-step path).
    """

    slots: list[SlotPlan]
    controller: Any = None  # a SyncController, or None
    ctrl_slot: int | None = None
    ctrl_state: Any = None
    scale: float = 1.0  # dyn_scale for the next step
    latched: list[bool] = field(default_factory=list)
    prev_gate: list[float] = field(default_factory=list)
    steps: int = 0
    feedback: bool = False
    last_pos: int = -1
    # position -> (mul, add) used for it: a recomputed position (after preemption) is steered exactly as before
    history: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)
    refs: list[tuple[np.ndarray, int, int, float]] = field(default_factory=list)  # (block, column, position, scale)
    # float32 (sharpness, threshold, floor) per slot: the kernel's gate parameters, for raw_gates
    params: np.ndarray = field(default_factory=lambda: np.zeros((3, 0), np.float32))

    @classmethod
    def for_policy(cls, policy: "DynamicSteeringPolicy", registry: Any = None,
                   max_scale: float = float("inf")) -> "DynState":
        """The state of a request under ``policy`` (resolved); custom controllers come from ``registry`` and their
        output is bounded by ``max_scale``."""
        from dynsteer.controllers.sync import make_controller

        slots, ctrl_slot = policy_slots(policy)
        ctrl = make_controller(policy.controller, registry, max_scale) if policy.controller is not None else None
        g = len(slots)
        feedback = ctrl is not None or any(s.scope in ("next_step", "rest_of_request") for s in slots)
        return cls(slots=slots, controller=ctrl, ctrl_slot=ctrl_slot,
                   ctrl_state=ctrl.initial_state() if ctrl is not None else None,
                   scale=0.0 if ctrl is not None else 1.0, latched=[False] * g, prev_gate=[0.0] * g,
                   feedback=feedback,
                   params=np.array([[s.sharpness, s.threshold, s.floor] for s in slots], np.float32).T.copy())

    def multipliers(self) -> tuple[list[float], list[float]]:
        """``(mul, add)`` per slot for the request's next decode token."""
        d = self.scale
        mul, add = [0.0] * len(self.slots), [0.0] * len(self.slots)
        for s, slot in enumerate(self.slots):
            if slot.scope == "next_step":
                add[s] = d * self.prev_gate[s]
            elif slot.scope == "rest_of_request" and self.latched[s]:
                add[s] = d
            else:
                mul[s] = d
        return mul, add

    def observe(self, block: np.ndarray, col: int, position: int) -> None:
        """Record one computed decode token; in the sync tier, advance the carried state and the controller."""
        self.refs.append((block, col, position, self.scale))
        self.last_pos = position
        if not self.feedback:
            return
        from dynsteer.controllers.sync import StepObservation

        scores = block[:len(self.slots), col]
        raw = raw_gates(scores, self.params).tolist()
        self.prev_gate = raw
        self.latched = [was or (g >= FIRE_GATE and g > 0) for was, g in zip(self.latched, raw)]
        if self.controller is not None:
            c = self.ctrl_slot
            obs = StepObservation(step=self.steps, position=position, score=float(scores[c]), gate=raw[c])
            self.ctrl_state, scale = self.controller.on_step(self.ctrl_state, obs)
            self.scale = float(scale)
        self.steps += 1

    def trace(self) -> dict[str, list]:
        """The trace fields (see :class:`dynsteer.trace.DynamicTrace`)."""
        g = len(self.slots)
        if not self.refs:
            return {"position": [], "score": [], "gate": [], "applied": [], "scale": []}
        half = self.refs[0][0].shape[0] // 2
        scores = np.stack([b[:g, c] for b, c, _, _ in self.refs]).astype(np.float32)
        applied = np.stack([b[half:half + g, c] for b, c, _, _ in self.refs])
        gate = raw_gates(scores, self.params)
        return {"position": [p for _, _, p, _ in self.refs], "score": scores.astype(np.float64).tolist(),
                "gate": gate.astype(np.float64).tolist(), "applied": applied.astype(np.float64).tolist(),
                "scale": [sc for _, _, _, sc in self.refs]}


def raw_gates(scores: np.ndarray, params: np.ndarray) -> np.ndarray:
    """The kernel's gate in float32, ``σ(sharpness·(score − threshold))``, 0 below the floor, for scores ``[..., G]``
    and ``params`` = float32 ``[3, G]`` (sharpness, threshold, floor)."""
    k, th, floor = params
    with np.errstate(over="ignore"):  # exp overflow is a gate of exactly 0, as in the kernel
        g = np.float32(1) / (np.float32(1) + np.exp(-(k * (np.asarray(scores, np.float32) - th))))
    return np.where(g >= floor, g, np.float32(0)).astype(np.float32)


# ---- the per-step driver ------------------------------------------------------------------------------------------------
@dataclass
class StepTokens:
    """This step's dynamic decode tokens: batch index, position and owning request (index into ``req_ids``)."""

    req_ids: list[str]
    req: np.ndarray
    index: np.ndarray
    position: np.ndarray

    def __len__(self) -> int:
        return len(self.index)


@dataclass
class _Pending:
    event: Any
    host: torch.Tensor  # [2G, m]: scores then effective gates of the step's dynamic decode tokens
    tokens: StepTokens


@dataclass
class SyncStats:
    """Cost of the dynamic tier's host side (milliseconds, summed over steps)."""

    dynamic_steps: int = 0
    sync_steps: int = 0
    wait_ms: float = 0.0  # blocked waiting for the previous step's scores (sync tier only)
    host_ms: float = 0.0  # staging the per-token multipliers
    controller_ms: float = 0.0  # read-back bookkeeping, controllers and carried scopes
    device_ms: float = 0.0  # CUDA-event time of the per-step control copies (read one step late)


class DynamicDriver:
    """Stages gate multipliers before each forward and reads scores/gates back after it.

    The device multipliers hold ``mul = 1, add = 0`` (a plain in-graph gate) except on steps with sync-tier tokens,
    which write their own values and restore the defaults afterwards, so most steps copy nothing to the device.
    """

    def __init__(self, gate_mul: torch.Tensor, gate_add: torch.Tensor, scores: torch.Tensor,
                 gates: torch.Tensor) -> None:
        self.gate_mul, self.gate_add, self.scores, self.gates = gate_mul, gate_add, scores, gates
        self.cuda = gates.is_cuda
        g, n = gates.shape
        gate_mul.fill_(1.0)
        gate_add.zero_()
        depth = 4 if self.cuda else 1
        self._ctl = [torch.zeros(2, g, n, dtype=torch.float32, device="cpu", pin_memory=self.cuda)
                     for _ in range(depth)]
        for c in self._ctl:
            c[0].fill_(1.0)
        self._ctl_events: list[Any] = [None] * depth
        self._ctl_written: list[list[int]] = [[] for _ in range(depth)]  # token columns a slot holds values at
        self._i = 0
        self._dirty = 0  # device multipliers [:dirty] may hold a sync step's values
        self._side = torch.cuda.Stream(device=gates.device) if self.cuda else None
        self._pending: list[_Pending] = []
        self.faults: dict[str, str] = {}  # requests whose custom controller failed: stopped by the runtime
        self._step: StepTokens | None = None
        self._timing: list[tuple[Any, Any]] = []
        self.stats = SyncStats()

    def plan(self, states: dict[str, DynState], tokens: StepTokens, upto: int) -> None:
        """Stage ``(mul, add)`` for this step's sync-tier tokens (waiting for the previous step's read-back first)."""
        feedback = any(st.feedback for st in states.values())
        t0 = time.perf_counter()
        self.poll(states, block=feedback)
        t1 = time.perf_counter()
        if feedback:
            self.stats.wait_ms += (t1 - t0) * 1e3
            self.stats.sync_steps += 1
        self._step = tokens if len(tokens) else None
        if not len(tokens):
            return
        self.stats.dynamic_steps += 1
        staged = []
        if feedback:
            for k in range(len(tokens)):
                st = states[tokens.req_ids[tokens.req[k]]]
                if st.feedback:
                    pos = int(tokens.position[k])
                    kept = st.history.get(pos)
                    if kept is None:
                        kept = st.history[pos] = st.multipliers()
                    staged.append((int(tokens.index[k]), kept))
        if staged or self._dirty:
            self._stage(staged, max(upto, self._dirty))
            self._dirty = upto if staged else 0
        self.stats.host_ms += (time.perf_counter() - t1) * 1e3

    def _stage(self, staged: list[tuple[int, tuple[list[float], list[float]]]], upto: int) -> None:
        self._i = (self._i + 1) % len(self._ctl)
        if self._ctl_events[self._i] is not None:
            self._ctl_events[self._i].synchronize()
        src = self._ctl[self._i]
        ctl = src.numpy()
        # Back to defaults only now: this slot's previous copy has completed (the event above), so its DMA is done.
        for t in self._ctl_written[self._i]:
            ctl[0, :, t], ctl[1, :, t] = 1.0, 0.0
        self._ctl_written[self._i] = [t for t, _ in staged]
        for t, (mul, add) in staged:
            ctl[0, :len(mul), t], ctl[1, :len(add), t] = mul, add
        start = torch.cuda.Event(enable_timing=True) if self.cuda else None
        if start is not None:
            start.record()
        for s in range(self.gate_mul.shape[0]):
            self.gate_mul[s, :upto].copy_(src[0, s, :upto], non_blocking=self.cuda)
            self.gate_add[s, :upto].copy_(src[1, s, :upto], non_blocking=self.cuda)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._ctl_events[self._i] = end
            self._timing.append((start, end))
            self._read_timing()

    def after_forward(self) -> None:
        """Gather this step's scores and gates of dynamic tokens and start their copy to host."""
        tokens, self._step = self._step, None
        if tokens is None:
            return
        cols = torch.from_numpy(tokens.index.astype(np.int64))
        if self.cuda:
            cols = cols.pin_memory().to(self.gates.device, non_blocking=True)
        both = torch.cat([self.scores.index_select(1, cols), self.gates.index_select(1, cols)])
        if self.cuda:
            done = torch.cuda.Event()
            self._side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side):
                host = torch.empty(both.shape, dtype=both.dtype, device="cpu", pin_memory=True)
                host.copy_(both, non_blocking=True)
                both.record_stream(self._side)
                done.record(self._side)
            self._pending.append(_Pending(done, host, tokens))
        else:
            self._pending.append(_Pending(None, both.clone(), tokens))

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
            host, tok = pend.host.numpy(), pend.tokens
            for k in range(len(tok)):
                st = states.get(tok.req_ids[tok.req[k]])
                pos = int(tok.position[k])
                if st is None or pos <= st.last_pos:
                    continue  # finished meanwhile, or a recomputed position (already observed)
                try:
                    st.observe(host, k, pos)
                except ControllerFault as exc:
                    self.faults.setdefault(tok.req_ids[tok.req[k]], str(exc))
            self.stats.controller_ms += (time.perf_counter() - t0) * 1e3

    def _read_timing(self) -> None:
        # One step late: only events that already completed are read, so timing never blocks.
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.pop(0)
            self.stats.device_ms += start.elapsed_time(end)
