"""What an engine does with a policy it is sent: registered names only, resolved against the operator's registry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dynsteer.policy._policy import DynamicSteeringPolicy
from dynsteer.spec import SteeringValidationError


def admit_policy(policy: DynamicSteeringPolicy, probes: Mapping[str, Any], controllers: Any,
                 prefix: str = "policy.") -> DynamicSteeringPolicy:
    """What an engine does with a policy from a request (or set globally): resolve registered probe names against
    ``probes`` (file paths are refused), and check that a custom controller names a registered one.

    Raises:
        SteeringValidationError: naming the field (``policy.monitors[0].probe_file``, ``policy.controller.name``).
    """
    if policy.max_relative_dose is not None:
        raise SteeringValidationError(
            f"{prefix}max_relative_dose: enforced by the caller's process (dynsteer.Steerer, dynsteer sweep), which "
            f"measures the model's residual norms; an engine cannot, so it refuses the policy rather than run it "
            f"without its guardrail (check the dose with dynsteer.dose before sending, or send it through a Steerer)")
    resolved = policy.resolved(probes, allow_files=False, prefix=prefix)
    spec = policy.controller
    where = f"{prefix}controller"
    while spec is not None:
        if spec.kind == "custom" and spec.name not in controllers:
            known = ", ".join(sorted(controllers)) or "none registered"
            raise SteeringValidationError(
                f"{where}.name: unknown controller {spec.name!r} (registered: {known}; the operator registers "
                f"controllers with DynsteerConfig(controllers={{name: 'package.module:Factory'}}))")
        spec, where = spec.inner, f"{where}.inner"
    return resolved
