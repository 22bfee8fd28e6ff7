"""One request's dynamic state on a worker: its gate slots, carried gates and host-tier controller, and the gate
parameters each of its tokens was computed with (a monitor's command may retune them mid-request).

The state holds the *host* copy of a gate's parameters; the device controller slot and the table row hold the other
two, and the worker's one retune path (``SteeringRuntime.retune``) moves all three together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dynsteer.controllers.sync import StepObservation, SyncController, make_controller
from dynsteer.kernels.controller_reference import FIRE_GATE
from dynsteer.request.compile_policy import SlotPlan, abort_slots, policy_slots

if TYPE_CHECKING:
    from dynsteer.controllers.registry import ControllerRegistry
    from dynsteer.policy import DynamicSteeringPolicy, SyncControllerSpec


@dataclass
class DynState:
    """One request's dynamic state on a worker.

    Three tiers of per-step work:

    * plain in-graph gates (``this_token`` rules, no controller): nothing per step; the trace is assembled from
      the read-back blocks when the request finishes;
    * the **device** sync tier (built-in controllers, ``next_step`` / ``rest_of_request`` scopes): the controller
      and the carried gates live in a slot of the driver's device buffer (``device_slot``) and are advanced by a
      kernel after each forward; the host never waits for them;
    * the **host** sync tier (``kind="custom"`` controllers, or a built-in one when no device slot is free): the
      Python controller runs on the read-back scores, so the host waits for the previous step (one step of
      latency, at the price of vLLM's asynchronous scheduling).
    """

    slots: list[SlotPlan]
    controller: SyncController[Any] | None = None  # the host tier's controller
    ctrl_spec: SyncControllerSpec | None = None  # the controller's spec (the device tier is built from it)
    ctrl_slot: int | None = None
    ctrl_state: Any = None  # the controller's own state (its type is the controller's)
    scale: float = 1.0  # host tier: dyn_scale for the next step
    latched: list[bool] = field(default_factory=list)
    prev_gate: list[float] = field(default_factory=list)
    steps: int = 0
    sync: bool = False  # in a sync tier (device or host)
    device_slot: int | None = None
    tier: str = ""  # set by the driver once: "plain" (no sync tier), "device" or "host"
    keep: bool = False  # the caller asked for the trace
    # The request's slot in the driver's ReadbackStore (its read-back values, appended a step at a time): kept for a
    # trace, and in the device tier, where a position computed again after preemption replays its first values.
    record: int | None = None
    last_pos: int = -1  # host tier: the last position its controller observed
    # host tier: position -> (mul, add, scale) staged for it; a recomputed position (after preemption) replays it
    staged: dict[int, tuple[list[float], list[float], float]] = field(default_factory=dict)
    # float32 (sharpness, threshold, floor) per slot: the kernel's gate parameters, for raw_gates
    params: np.ndarray = field(default_factory=lambda: np.zeros((3, 0), np.float32))
    # Gate parameters of earlier retunes, as (first position computed with the next ones, params before): a read-back
    # is judged by the parameters its token was computed with, which a command may have changed since.
    retunes: list[tuple[int, np.ndarray]] = field(default_factory=list)
    # params in effect before a retune whose first position is not known yet (the request was not scheduled since)
    retune_pending: np.ndarray | None = None
    # slot -> stop reason, for enabled rules with ``abort`` (watched on the read-backs; see DynamicDriver.poll)
    aborts: dict[int, str] = field(default_factory=dict)
    held: int | None = None  # prompt-level slots: the request's row of the driver's held-gate buffer
    decided: bool = False  # prompt-level slots: the prompt's last token has been scheduled (its gates latch once)
    mean_next: int = 0  # prompt-mean slots: prompt positions below this one are summed already (once each)

    @classmethod
    def for_policy(cls, policy: DynamicSteeringPolicy, registry: ControllerRegistry | None = None,
                   max_scale: float = float("inf")) -> DynState:
        """The state of a request under ``policy`` (resolved); custom controllers come from ``registry`` and their
        output is bounded by ``max_scale``. It starts in the host tier; the driver moves it to the device tier."""
        slots, ctrl_slot = policy_slots(policy)
        ctrl = make_controller(policy.controller, registry, max_scale) if policy.controller is not None else None
        g = len(slots)
        sync = ctrl is not None or any(s.scope in ("next_step", "rest_of_request") for s in slots)
        st = cls(slots=slots, controller=ctrl, ctrl_spec=policy.controller, ctrl_slot=ctrl_slot,
                 ctrl_state=ctrl.initial_state() if ctrl is not None else None,
                 scale=0.0 if ctrl is not None else 1.0, latched=[False] * g, prev_gate=[0.0] * g, sync=sync)
        st._take(policy)
        return st

    def _take(self, policy: DynamicSteeringPolicy) -> None:
        self.slots, _ = policy_slots(policy)
        self.params = np.array([[s.sharpness, s.threshold, s.floor] for s in self.slots], np.float32).T.copy()
        self.aborts = abort_slots(policy)

    def retune(self, policy: DynamicSteeringPolicy) -> None:
        """Take ``policy``'s thresholds, rule switches and aborts (same slots: a monitor's command patched it; the
        controller and carried state are kept). Only the host copy: ``SteeringRuntime.retune`` moves every copy.

        Tokens computed before the change keep being judged by the parameters they were computed with
        (:meth:`params_at`) once :meth:`retuned_from` names the first position computed after it."""
        if self.retune_pending is None:  # two retunes before the request computes again: the first params held
            self.retune_pending = self.params
        self._take(policy)

    def retuned_from(self, position: int) -> None:
        """The request computes ``position`` first under the parameters of the last :meth:`retune`."""
        if self.retune_pending is not None:
            self.retunes.append((position, self.retune_pending))
            self.retune_pending = None

    def params_at(self, positions: np.ndarray) -> np.ndarray:
        """The gate parameters each of ``positions`` was computed with: ``[3, G]`` when they are all the current
        ones, else ``[3, T, G]`` (both broadcast against scores ``[T, G]`` in :func:`raw_gates`)."""
        if not self.retunes and self.retune_pending is None:
            return self.params
        positions = np.asarray(positions, np.int64).reshape(-1)
        out = np.repeat(self.params[:, None, :], len(positions), axis=1)
        if self.retune_pending is not None:  # nothing was computed under the current params yet
            out[:] = self.retune_pending[:, None, :]
        for until, params in reversed(self.retunes):  # older spans last: they win over newer ones
            out[:, positions < until, :] = params[:, None, :]
        return out

    @property
    def act_mask(self) -> int:
        """Bitmask of the gate slots whose gate steers (a rule's slot; a controller-only monitor's does not)."""
        return sum(1 << i for i, slot in enumerate(self.slots) if slot.scope != "monitor" and slot.acts)

    @property
    def prompt_level(self) -> bool:
        """Whether any slot is a prompt-level gate (held from the prompt's last token)."""
        return any(s.prompt for s in self.slots)

    @property
    def host_tier(self) -> bool:
        return self.tier == "host"

    @property
    def device_eligible(self) -> bool:
        """A sync-tier request whose controller (if any) the device kernel implements."""
        return self.sync and (self.ctrl_spec is None or not _has_custom(self.ctrl_spec))

    def multipliers(self) -> tuple[list[float], list[float]]:
        """Host tier: ``(mul, add)`` per slot for the request's next decode token."""
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
        """Host tier: advance the carried state and the controller from one computed decode token (column ``col``
        of a read-back block)."""
        self.last_pos = position
        scores = block[:len(self.slots), col]
        raw = raw_gates(scores[None, :], self.params_at(np.array([position])))[0].tolist()
        self.prev_gate = raw
        self.latched = [was or (g >= FIRE_GATE and g > 0) for was, g in zip(self.latched, raw)]
        if self.controller is not None:
            c = self.ctrl_slot
            obs = StepObservation(step=self.steps, position=position, score=float(scores[c]), gate=raw[c])
            self.ctrl_state, scale = self.controller.on_step(self.ctrl_state, obs)
            self.scale = float(scale)
        self.steps += 1

    def report_fields(self, positions: np.ndarray, values: np.ndarray) -> dict[str, list]:
        """The fields of :meth:`trace` a report carries (``position``, ``score``, ``applied``), without the raw gate
        and scale it does not send: a report request pays this every step."""
        g = len(self.slots)
        G = (values.shape[1] - 1) // 4
        scores = values[:, :g].astype(np.float64)
        if self.prompt_level:  # a prompt-level slot has no per-token score
            scores[:, [i for i, slot in enumerate(self.slots) if slot.prompt]] = np.nan
        return {"position": positions.tolist(), "score": scores.tolist(),
                "applied": values[:, G:G + g].astype(np.float64).tolist()}

    def trace(self, positions: np.ndarray, values: np.ndarray) -> dict[str, list]:
        """The trace fields (see :class:`dynsteer.trace.DynamicTrace`) from the request's record: ``positions [T]``
        and read-back ``values [T, 4G+1]``."""
        g = len(self.slots)
        G = (values.shape[1] - 1) // 4
        gate = raw_gates(values[:, :g], self.params_at(positions)) if len(values) else values[:, :g].copy()
        prompt = [i for i, slot in enumerate(self.slots) if slot.prompt]
        if prompt and len(values):  # no per-token score: the gate is the held prompt decision (what was applied)
            gate[:, prompt] = values[:, G:G + g][:, prompt]
        return {**self.report_fields(positions, values), "gate": gate.astype(np.float64).tolist(),
                "scale": values[:, 4 * G].astype(np.float64).tolist()}


def fired_aborts(st: DynState, host: np.ndarray, cols: np.ndarray,
                 positions: np.ndarray) -> tuple[int, str] | None:
    """The first of ``positions`` (read-back columns ``cols`` of one request) where one of its abort rules fired
    (its gate ≥ ``FIRE_GATE`` and over its floor), and that rule's reason; ``None`` if none did."""
    slots = sorted(st.aborts)
    gates = raw_gates(host[:len(st.slots)][:, cols].T, st.params_at(positions))[:, slots]  # [tokens, abort slots]
    fired = (gates >= FIRE_GATE) & (gates > 0)
    if not fired.any():
        return None
    k = int(np.argmax(fired.any(1)))
    return int(positions[k]), st.aborts[slots[int(np.argmax(fired[k]))]]


def _has_custom(spec: SyncControllerSpec | None) -> bool:
    while spec is not None:
        if spec.kind == "custom":
            return True
        spec = spec.inner
    return False


def raw_gates(scores: np.ndarray, params: np.ndarray) -> np.ndarray:
    """The kernel's gate in float32, ``σ(sharpness·(score − threshold))``, 0 below the floor, for scores ``[..., G]``
    and ``params`` = float32 ``[3, G]`` (sharpness, threshold, floor), or ``[3, T, G]`` per token of scores
    ``[T, G]``."""
    k, th, floor = params
    with np.errstate(over="ignore"):  # exp overflow is a gate of exactly 0, as in the kernel
        g = np.float32(1) / (np.float32(1) + np.exp(-(k * (np.asarray(scores, np.float32) - th))))
    return np.where(g >= floor, g, np.float32(0)).astype(np.float32)
