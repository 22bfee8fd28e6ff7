"""Dynamic steering policies: monitors (in-graph probe gates), rules (what a gate switches on) and a sync controller.

A :class:`DynamicSteeringPolicy` is the schema of the dynamic tiers of architecture §4. Like :mod:`dynsteer.spec` it is
pydantic, immutable, versioned and free of vLLM and torch imports, so it can be written in a notebook, saved as
YAML/JSON, shipped with a request and validated against a model's shape (:meth:`DynamicSteeringPolicy.check`) before
anything reaches the engine.

Semantics:
    * A :class:`ProbeGate` reads the residual at ``(layer, site)`` of each generated token and computes
      ``score = x·direction`` and ``gate = σ(sharpness · (score − threshold))`` inside the forward (the in-graph
      monitor of the dynamic op, :mod:`dynsteer.kernels.dynamic_reference`). Prompt (prefill) tokens are never
      gated: their gate is 0. The monitor reads the residual *before* any dynamic action at the same site.
    * A :class:`Rule` ties a monitor to actions. ``gate`` values below ``gate_floor`` count as 0. Each action is the
      dynamic term ``g · dyn_scale · action`` of architecture §3: an ``add`` adds ``g · dyn_scale · scale · vector``; a
      ``clamp``/``ablate`` uses ``g · dyn_scale · strength`` as its strength. ``dyn_scale`` is the sync controller's
      output (1 without a controller).
    * ``scope`` says when the gate acts: ``this_token`` — in the same forward pass, on the same token (the gate is
      carried forward from the monitor site, so actions can only steer the monitor's layer or later ones);
      ``next_step`` — the gate of token ``t`` steers token ``t + 1``; ``rest_of_request`` — once the gate fires
      (``g ≥ gate_floor`` and ``g > 0``) the actions stay on, at full gate, until the request finishes.
    * The optional :class:`SyncControllerSpec` is the sync actuator tier: after every step it sees the monitor's
      score/gate for the token just computed and sets ``dyn_scale`` for the next step
      (:mod:`dynsteer.controllers.sync`).

Example:
    >>> import numpy as np
    >>> from dynsteer.policy import Action, DynamicSteeringPolicy, ProbeGate, Rule, SyncControllerSpec
    >>> from dynsteer.spec import ModelShape
    >>> mon = ProbeGate(name="tox", layer=2, direction=np.eye(8)[0], sharpness=4.0, threshold=1.5)
    >>> rule = Rule(monitor="tox", actions=[Action(kind="add", layer=3, vector=-np.eye(8)[0], scale=2.0)])
    >>> policy = DynamicSteeringPolicy(monitors=[mon], rules=[rule],
    ...                                controller=SyncControllerSpec(kind="latch", on=2.0, off=1.0, scale=1.0))
    >>> DynamicSteeringPolicy.from_yaml(policy.to_yaml()) == policy
    True
    >>> policy.check(ModelShape(num_layers=4, hidden_size=8))
"""

from __future__ import annotations

# The schema is split by concern into private modules (gates, actions, rules, controller, the policy, its admission
# by an engine); this face is the public API: ``from dynsteer.policy import ...``.
from dynsteer._deprecated import renamed
from dynsteer.policy._actions import Action
from dynsteer.policy._admission import admit_policy
from dynsteer.policy._controller import ControllerKind, SyncControllerSpec, check_controller, controller_bound
from dynsteer.policy._gates import (MAX_ABS_THRESHOLD, MAX_SHARPNESS, MIN_SHARPNESS, MonitorReads, ProbeGate,
                                    gate_param_problem)
from dynsteer.policy._policy import POLICY_VERSION, DynamicSteeringPolicy, RelativeDoseLimit
from dynsteer.policy._rules import Rule, Scope

__all__ = ["Action", "ControllerKind", "DynamicSteeringPolicy", "MAX_ABS_THRESHOLD", "MAX_SHARPNESS", "MIN_SHARPNESS",
           "POLICY_VERSION", "ProbeGate", "RelativeDoseLimit", "MonitorReads", "Rule", "Scope", "SyncControllerSpec",
           "admit_policy", "check_controller", "controller_bound", "gate_param_problem"]

# Old name kept for one release: the in-graph gate was ``Monitor``, a name the monitor-service client also had.
__getattr__ = renamed(__name__, {"Monitor": ("ProbeGate", ProbeGate)})
