"""Lay a dynamic policy out over gate slots, and compile it into what a request's rows hold.

A policy's rules each own one *gate slot* (in order), plus one for a controller's monitor when no rule reads it,
plus one per prompt-level condition. The decode row carries, at each per-token monitor's site, the probe that
computes its slot's gate, and at each action's site the gated vector or clamp that reads it; the prefill row carries
only the prompt-level monitors (they score the prompt, never steer it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from dynsteer.request.programs import Clamp, MagnitudeBudget, MonitorProgram, SiteKey, SiteProgram, max_abs
from dynsteer.spec import ModelShape, SteeringValidationError, resolve_vector

if TYPE_CHECKING:
    from dynsteer.policy import DynamicSteeringPolicy


@dataclass(frozen=True)
class SlotPlan:
    """What one gate slot computes and how its gate is carried across steps."""

    monitor: str
    sharpness: float
    threshold: float
    floor: float
    scope: str  # a rule's scope; "monitor" for a controller-only slot (no actions)
    acts: bool = True  # its rule is enabled and has actions (a disabled rule's gate is computed, never applied)
    prompt: bool = False  # a prompt-level monitor: its gate is computed once at the prompt's last token and held
    mean: bool = False  # prompt-level over the mean score of every prompt token (else the last token's score)
    cond: int | None = None  # the slot of the rule's prompt-level condition (its held gate multiplies this one)


def policy_slots(policy: DynamicSteeringPolicy) -> tuple[list[SlotPlan], int | None]:
    """The policy's gate slots (rules in order, then the controller's monitor if no rule reads it) and the slot
    feeding the controller (``None`` without one). The policy must be resolved (inline monitors)."""
    slots = []
    for rule in policy.rules:
        m = policy.monitor(rule.monitor)
        slots.append(SlotPlan(m.name, float(m.sharpness), float(m.threshold), rule.gate_floor, rule.scope,
                              rule.enabled and bool(rule.actions), prompt=m.reads != "token",
                              mean=m.reads == "prompt_mean"))
    ctrl_slot = None
    cm = policy.controller_monitor()
    if cm is not None:
        ctrl_slot = next((i for i, s in enumerate(slots) if s.monitor == cm.name), None)
        if ctrl_slot is None:
            slots.append(SlotPlan(cm.name, float(cm.sharpness), float(cm.threshold), 0.0, "monitor"))
            ctrl_slot = len(slots) - 1
    # each prompt-level condition gets a slot of its own (no floor, no actions): its held gate is the multiplier
    conds: dict[str, int] = {}
    for i, rule in enumerate(policy.rules):
        if rule.condition is None:
            continue
        if rule.condition not in conds:
            m = policy.monitor(rule.condition)
            slots.append(SlotPlan(m.name, float(m.sharpness), float(m.threshold), 0.0, "monitor", acts=False,
                                  prompt=True, mean=m.reads == "prompt_mean"))
            conds[rule.condition] = len(slots) - 1
        slots[i] = replace(slots[i], cond=conds[rule.condition])
    return slots, ctrl_slot


def compile_prompt_monitors(policy: DynamicSteeringPolicy, shape: ModelShape,
                            prefix: str = "policy.") -> dict[SiteKey, SiteProgram]:
    """The monitors a policy's prompt-level slots put into the request's *prefill* row (their scores at the prompt's
    last token decide the held gates; prefill rows carry no gated action, so they steer nothing)."""
    slots, _ = policy_slots(policy)
    sites: dict[SiteKey, SiteProgram] = {}
    for s, slot in enumerate(slots):
        if slot.prompt:
            m = policy.monitor(slot.monitor)
            probe = resolve_vector(m.direction, f"{prefix}monitors.{m.name}.direction", shape, None)
            prog = sites.setdefault((m.layer, m.site), SiteProgram())
            prog.monitors[s] = MonitorProgram(probe.astype(np.float32), slot.sharpness, slot.threshold, slot.floor)
    return sites


def compile_policy(policy: DynamicSteeringPolicy, shape: ModelShape, named: dict[str, np.ndarray] | None,
                   prefix: str = "policy.", budget: MagnitudeBudget | None = None) -> dict[SiteKey, SiteProgram]:
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
            f"when no rule reads it, plus one per prompt-level condition); {what} (raise DynsteerConfig.max_gates)")
    sites: dict[SiteKey, SiteProgram] = {}
    for s, slot in enumerate(slots):
        if slot.prompt:  # no per-token monitor: the slot's gate is staged from the held prompt decision
            continue
        m = policy.monitor(slot.monitor)
        probe = resolve_vector(m.direction, f"{prefix}monitors.{m.name}.direction", shape, None)
        prog = sites.setdefault((m.layer, m.site), SiteProgram())
        prog.monitors[s] = MonitorProgram(probe.astype(np.float32), slot.sharpness, slot.threshold, slot.floor)
    for s, rule in enumerate(policy.rules):
        for j, a in enumerate(rule.actions if rule.enabled else ()):
            v = resolve_vector(a.vector, f"{prefix}rules[{s}].actions[{j}].vector", shape, named)
            prog = sites.setdefault((a.layer, a.site), SiteProgram())
            if a.kind == "add":
                if budget is not None:
                    budget.add(abs(a.scale) * dyn_bound * max_abs(v),
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


def abort_slots(policy: DynamicSteeringPolicy) -> dict[int, str]:
    """Gate slot -> stop reason of the policy's enabled rules with ``abort`` (rules take slots in order)."""
    return {i: f"dynsteer policy: rule {i} (monitor {rule.monitor}): {rule.abort}"
            for i, rule in enumerate(policy.rules) if rule.abort is not None and rule.enabled}
