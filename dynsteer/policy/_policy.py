"""The policy: monitors, the rules they gate and an optional sync controller, checked as a whole (references,
placement of actions after their monitor) and against a model's shape."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, Optional

import numpy as np
from pydantic import Field, model_validator

from dynsteer.policy._base import FrozenModel, finite_fields
from dynsteer.policy._controller import SyncControllerSpec, check_controller, controller_bound
from dynsteer.policy._gates import ProbeGate, check_gate
from dynsteer.policy._rules import Rule
from dynsteer.spec import (SITES, ModelShape, Real, SteeringValidationError, check_clamp_bounds, check_site,
                           resolve_vector)

POLICY_VERSION = 1


def _site_order(site: str) -> int:
    return SITES.index(site)  # type: ignore[arg-type]


class RelativeDoseLimit(FrozenModel):
    """A guardrail on each additive action's relative dose ``|scale|·‖v‖ / mean‖h‖`` (:mod:`dynsteer.dose`).

    Checked where the caller admits the policy (:class:`dynsteer.Steerer` before sending it, ``dynsteer sweep``),
    against the residual norms measured once per model. A bare number is accepted as ``limit``.

    Args:
        limit: the largest relative dose, ``> 0``, at the controller's largest output
            (:meth:`DynamicSteeringPolicy.max_output`).
        mode: ``reject`` (a ``SteeringValidationError`` naming the action and its dose) or ``clip`` (the action's
            scale is reduced to the limit, and reported).

    Example:
        >>> RelativeDoseLimit.model_validate(0.5)
        RelativeDoseLimit(limit=0.5, mode='reject')
    """

    limit: Real = Field(gt=0.0)
    mode: Literal["reject", "clip"] = "reject"

    @model_validator(mode="before")
    @classmethod
    def _bare_number(cls, data: Any) -> Any:
        return {"limit": data} if isinstance(data, (int, float)) and not isinstance(data, bool) else data

    _finite_limit = finite_fields("limit")


class DynamicSteeringPolicy(FrozenModel):
    """Monitors, the rules they gate, and an optional sync controller: one request's dynamic steering.

    Args:
        version: schema version (1).
        monitors: in-graph probe gates, unique names.
        rules: each a monitor and the actions its gate scales.
        controller: optional sync controller setting ``dyn_scale`` every step.
        max_relative_dose: optional :class:`RelativeDoseLimit` on additive actions (enforced by the caller's
            process, which knows the model's residual norms, and removed from the policy it sends; an engine
            refuses a policy that still carries it, naming the field, rather than run it unguarded).

    Raises:
        pydantic.ValidationError: (a ``ValueError``) duplicate monitor names, a rule naming an unknown monitor, an
            action steering a layer/site before its monitor's (e.g. ``rules[0].actions[1].layer``), or a controller
            without a well-defined monitor. The message names the field.

    Example:
        >>> from dynsteer.policy import Action, DynamicSteeringPolicy, ProbeGate, Rule
        >>> p = DynamicSteeringPolicy(
        ...     monitors=[ProbeGate(name="m", layer=3, direction=[1.0, 0.0], sharpness=1.0, threshold=0.0)],
        ...     rules=[Rule(monitor="m", actions=[Action(kind="ablate", layer=3, vector=[0.0, 1.0])])])
        >>> DynamicSteeringPolicy.from_json(p.to_json()) == p
        True
    """

    version: Literal[1] = POLICY_VERSION
    monitors: tuple[ProbeGate, ...] = ()
    rules: tuple[Rule, ...] = ()
    controller: Optional[SyncControllerSpec] = None
    max_relative_dose: Optional[RelativeDoseLimit] = None

    @model_validator(mode="after")
    def _references(self) -> "DynamicSteeringPolicy":
        by_name: dict[str, ProbeGate] = {}
        for i, m in enumerate(self.monitors):
            if m.name in by_name:
                raise ValueError(f"monitors[{i}].name: duplicate monitor name {m.name!r}")
            by_name[m.name] = m
        known = ", ".join(sorted(by_name)) or "none defined"
        for i, rule in enumerate(self.rules):
            mon = by_name.get(rule.monitor)
            if mon is None:
                raise ValueError(f"rules[{i}].monitor: unknown monitor {rule.monitor!r} (known: {known})")
            if rule.condition is not None:
                cond = by_name.get(rule.condition)
                if cond is None:
                    raise ValueError(f"rules[{i}].condition: unknown monitor {rule.condition!r} (known: {known})")
                if cond.reads == "token":
                    raise ValueError(f"rules[{i}].condition: monitor {cond.name!r} reads every token; a condition "
                                     f"is a prompt-level monitor (reads='prompt_last' or 'prompt_mean')")
            if mon.reads != "token":
                if rule.scope != "this_token":
                    raise ValueError(f"rules[{i}].scope: monitor {mon.name!r} reads the prompt, so its gate is "
                                     f"already held for the whole request; use the default scope 'this_token'")
                if rule.abort is not None:
                    raise ValueError(f"rules[{i}].abort: not supported for a prompt-level monitor ({mon.name!r})")
                continue  # the held gate exists before the first generated token reaches any layer
            for j, a in enumerate(rule.actions):
                where = f"rules[{i}].actions[{j}]"
                if a.layer < mon.layer:
                    raise ValueError(
                        f"{where}.layer: layer {a.layer} is before monitor {mon.name!r}'s layer {mon.layer}; the "
                        f"gate is computed at the monitor site and carried forward, so it can only steer layer "
                        f"{mon.layer} (site {mon.site!r} or later) and later layers")
                if a.layer == mon.layer and _site_order(a.site) < _site_order(mon.site):
                    raise ValueError(
                        f"{where}.site: site {a.site!r} at layer {a.layer} comes before monitor {mon.name!r}'s "
                        f"site {mon.site!r}; the gate does not exist yet there")
        prompt_level = [m.name for m in self.monitors if m.reads != "token"]
        if prompt_level and (self.controller is not None or any(r.scope != "this_token" for r in self.rules)):
            where = "controller" if self.controller is not None else next(
                f"rules[{i}].scope" for i, r in enumerate(self.rules) if r.scope != "this_token")
            raise ValueError(f"{where}: prompt-level monitors ({', '.join(prompt_level)}) cannot yet be combined "
                             f"with a sync controller or next_step / rest_of_request rules")
        if self.controller is not None:
            if self.controller.monitor is None:
                if len(self.monitors) != 1:
                    raise ValueError(f"controller.monitor: name the monitor that feeds the controller (the policy "
                                     f"has {len(self.monitors)} monitors: {known})")
            elif self.controller.monitor not in by_name:
                raise ValueError(f"controller.monitor: unknown monitor {self.controller.monitor!r} (known: {known})")
        return self

    def monitor(self, name: str) -> ProbeGate:
        """The monitor called ``name`` (``KeyError`` if none)."""
        for m in self.monitors:
            if m.name == name:
                return m
        raise KeyError(name)

    def controller_monitor(self) -> ProbeGate | None:
        """The monitor feeding the controller (``None`` without a controller)."""
        if self.controller is None:
            return None
        return self.monitor(self.controller.monitor) if self.controller.monitor else self.monitors[0]

    def resolved(self, probes: Mapping[str, Any] | None = None, *, allow_files: bool = True,
                 prefix: str = "") -> "DynamicSteeringPolicy":
        """A copy whose monitors are all inline.

        Args:
            probes: registered probes that monitors' ``probe`` may name.
            allow_files: read ``probe_file`` monitors (the caller's own process; engines pass ``False``).
            prefix: prepended to field names in messages.

        Raises:
            SteeringValidationError: naming the monitor field that cannot be resolved.
        """
        monitors = []
        for i, m in enumerate(self.monitors):
            try:
                resolved = m.resolve(probes, allow_files=allow_files)
            except (OSError, ValueError) as exc:
                field = "probe" if m.probe is not None else "probe_file"
                raise SteeringValidationError(f"{prefix}monitors[{i}].{field}: {exc}") from None
            if not m.is_inline and resolved.is_inline:  # a probe's weight norm and bias become the gate's values
                check_gate(resolved, f"{prefix}monitors[{i}]", m)
            monitors.append(resolved)
        upd: dict[str, Any] = {"monitors": tuple(monitors)}
        if self.controller is not None and all(m.is_inline for m in monitors):
            cm = self.controller.monitor
            mon = next(m for m in monitors if m.name == cm) if cm else monitors[0]
            upd["controller"] = self.controller.in_score_units(mon, f"{prefix}controller")
        return self.model_copy(update=upd)

    def max_output(self) -> float:
        """The largest ``|dyn_scale|`` the controller can output (1 without one; custom: unbounded, clipped by
        the engine's ``max_dyn_scale`` at run time)."""
        return 1.0 if self.controller is None else controller_bound(self.controller)

    def layers(self) -> list[int]:
        """Every layer a monitor reads or an action steers."""
        return sorted({m.layer for m in self.monitors} | {a.layer for r in self.rules for a in r.actions})

    def check(self, shape: ModelShape, named: dict[str, np.ndarray] | None = None, prefix: str = "") -> None:
        """Validate against a model like :func:`dynsteer.spec.check_spec`.

        Checks layer ranges and hooked layers/sites of monitors and actions, vector hidden sizes, finite values and
        non-zero directions, gate parameters within :data:`MIN_SHARPNESS`/:data:`MAX_SHARPNESS` and
        :data:`MAX_ABS_THRESHOLD`, clamp bounds and strengths, the controller's output bound; resolves probe
        monitors and checks them too.

        Args:
            shape: the engine's model shape (and its magnitude limits).
            named: registered vectors for actions that refer to a vector by name.
            prefix: prepended to field names in messages (e.g. ``"policy."``).

        Registered names (probes, custom controllers) are checked where the registry is: :func:`admit_policy`.

        Raises:
            SteeringValidationError: naming the first bad field (e.g. ``monitors[0].direction``).
        """
        def place(where: str, layer: int, site: str) -> None:
            if layer >= shape.num_layers:
                raise SteeringValidationError(
                    f"{where}.layer: layer {layer} out of range; the model has {shape.num_layers} layers "
                    f"(0..{shape.num_layers - 1})")
            if shape.layers is not None and layer not in shape.layers:
                raise SteeringValidationError(f"{where}.layer: layer {layer} is not hooked in this engine "
                                              f"(hooked: {list(shape.layers)})")
            check_site(site, shape, where)

        for i, source in enumerate(self.monitors):
            where = f"{prefix}monitors[{i}]"
            place(where, source.layer, source.site)
            m = source
            if not m.is_inline:
                try:
                    m = m.resolve()
                except (OSError, ValueError) as exc:
                    field = "probe" if m.probe is not None else "probe_file"
                    raise SteeringValidationError(f"{where}.{field}: {exc}") from None
                if not m.is_inline:
                    continue  # a registered name, checked where the registry is (the engine)
            arr = resolve_vector(m.direction, f"{where}.direction", shape, None)
            if not np.linalg.norm(arr.astype(np.float64)) > 0:
                raise SteeringValidationError(f"{where}.direction: direction has zero norm")
            for name in ("sharpness", "threshold"):
                if not math.isfinite(getattr(m, name)):
                    raise SteeringValidationError(f"{where}.{name}: must be finite")
            check_gate(m, where, source)
        for i, rule in enumerate(self.rules):
            for j, a in enumerate(rule.actions):
                where = f"{prefix}rules[{i}].actions[{j}]"
                place(where, a.layer, a.site)
                arr = resolve_vector(a.vector, f"{where}.vector", shape, named)
                if a.kind != "add":
                    if not np.linalg.norm(arr.astype(np.float64)) > 0:
                        raise SteeringValidationError(f"{where}.vector: direction has zero norm")
                    check_clamp_bounds(a, shape, where)
        if self.controller is not None:
            check_controller(self.controller, shape, f"{prefix}controller")

    def to_json(self) -> str:
        """JSON with vectors in the packed ``{"b64": ...}`` form (bit-exact round trip)."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> "DynamicSteeringPolicy":
        return cls.model_validate_json(text)

    def to_yaml(self) -> str:
        """YAML of the JSON form (vectors packed, bit-exact round trip)."""
        import yaml

        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "DynamicSteeringPolicy":
        import yaml

        return cls.model_validate(yaml.safe_load(text))

