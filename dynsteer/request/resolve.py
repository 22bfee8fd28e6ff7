"""A request's effective configuration: the precedence global < request < command, written once.

Three parties assemble it, each from its own copy of the inputs: admission in the frontend (salts and row digests),
the engine core's command desk (validates a monitor's command as the workers will compile it) and every worker
(compiles the request's rows). They all call :func:`resolve`, so the rule below changes in one place:

* static specs add up: the global spec, then the request's own (both phases, each entry's ``tier`` picks), then a
  monitor's ``steer`` command (decode phase only; a later ``steer`` replaces the earlier one, an empty or absent
  spec clears it);
* the dynamic policy is the first present of: the request's policy as ``threshold``/``rule`` commands patched it,
  the request's own policy, the global policy. Policies never merge.

Pure: policies arrive admitted (registered probes resolved by :func:`dynsteer.policy.admit_policy`; each process
admits for itself, which is the trust wall) and nothing is compiled here but in :func:`check_global`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from dynsteer.commands import RuleCommand, SteerCommand, ThresholdCommand, patch_policy
from dynsteer.request.compile_spec import compile_phase
from dynsteer.request.payload import PAYLOAD_KEY
from dynsteer.spec import ModelShape, Phase, SteeringSpec

if TYPE_CHECKING:
    from dynsteer.policy import DynamicSteeringPolicy

#: The field prefix each source's errors name.
GLOBAL_SPEC, GLOBAL_POLICY = "global.", "global_policy."
REQUEST_SPEC, REQUEST_POLICY = f"extra_args.{PAYLOAD_KEY}.spec.", f"extra_args.{PAYLOAD_KEY}.policy."
COMMAND_SPEC, COMMAND_POLICY = "command.spec.", "command.policy."

Specs = list[tuple[str, SteeringSpec]]


@dataclass(frozen=True)
class Configuration:
    """What one source sets: the global configuration, or a request's payload. ``policy`` is admitted."""

    spec: SteeringSpec | None = None
    policy: DynamicSteeringPolicy | None = None


@dataclass(frozen=True)
class CommandPatch:
    """What monitors' commands changed for one request: the latest ``steer`` command's spec (``None``: none, or
    cleared) and the effective policy as ``threshold``/``rule`` commands patched it (``None``: unpatched)."""

    spec: SteeringSpec | None = None
    policy: DynamicSteeringPolicy | None = None

    @property
    def empty(self) -> bool:
        return self.spec is None and self.policy is None


NO_COMMAND = CommandPatch()


@dataclass(frozen=True)
class Effective:
    """A request's effective configuration.

    Attributes:
        specs: the static specs of both phases in the order they apply, each with its field prefix (global, then
            the request's own; empty specs left out).
        command_specs: specs added to the decode phase only (a ``steer`` command).
        policy: the effective dynamic policy (``None``: none), and ``policy_field`` the prefix its errors name.
    """

    specs: tuple[tuple[str, SteeringSpec], ...] = ()
    command_specs: tuple[tuple[str, SteeringSpec], ...] = ()
    policy: DynamicSteeringPolicy | None = None
    policy_field: str = ""

    def phase_specs(self, phase: Phase) -> Specs:
        """The specs one phase compiles, in order."""
        return [*self.specs, *self.command_specs] if phase == "decode" else list(self.specs)

    @property
    def gates(self) -> bool:
        """Whether the policy gates anything (rules or a controller): only then is it compiled into rows and does
        the request get dynamic state."""
        return self.policy is not None and bool(self.policy.rules or self.policy.controller)

    @property
    def policy_entry(self) -> tuple[str, DynamicSteeringPolicy] | None:
        """``(field prefix, policy)`` for :func:`~dynsteer.request.compile_spec.compile_phase`, whatever it gates
        (admission validates a policy in full)."""
        return None if self.policy is None else (self.policy_field, self.policy)

    @property
    def gated_policy(self) -> tuple[str, DynamicSteeringPolicy] | None:
        """:attr:`policy_entry` where the policy gates something, else ``None`` (what rows are compiled with)."""
        return self.policy_entry if self.gates else None

    @property
    def reads_prompt(self) -> bool:
        """Whether a monitor of the policy decides on the prompt (a prompt-level gate): its prefill row only reads,
        so the prompt's KV, and its cache key, are those of the policy-free prefill."""
        return self.policy is not None and any(m.reads != "token" for m in self.policy.monitors)

    @property
    def prompt_mean(self) -> bool:
        """Whether a monitor reads the mean over the prompt: every prompt token must be computed."""
        return self.policy is not None and any(m.reads == "prompt_mean" for m in self.policy.monitors)


def resolve(global_config: Configuration, request: Configuration | None = None,
            command: CommandPatch = NO_COMMAND) -> Effective:
    """The effective configuration of a request under the global one and monitors' commands (see the module
    docstring for the rule). ``request``: ``None`` for a request without a payload."""
    request = request or Configuration()
    specs = tuple((prefix, spec) for prefix, spec in ((GLOBAL_SPEC, global_config.spec), (REQUEST_SPEC, request.spec))
                  if spec is not None and not spec.is_empty())
    extra = ((COMMAND_SPEC, command.spec),) if command.spec is not None and not command.spec.is_empty() else ()
    for field, policy in ((COMMAND_POLICY, command.policy), (REQUEST_POLICY, request.policy),
                          (GLOBAL_POLICY, global_config.policy)):
        if policy is not None:
            return Effective(specs, extra, policy, field)
    return Effective(specs, extra)


def apply_command(patch: CommandPatch, command: SteerCommand | ThresholdCommand | RuleCommand,
                  global_config: Configuration, request: Configuration | None = None) -> CommandPatch:
    """``patch`` after one more command: a ``steer`` replaces the previous one's spec (an empty or absent spec
    clears it); a ``threshold`` or ``rule`` patches the effective policy (already patched, else the request's, else
    the global one).

    Raises:
        SteeringValidationError: naming ``command.monitor``/``command.rule``/``command.request`` when the effective
            policy has no such monitor or rule, or there is none.
    """
    if isinstance(command, SteerCommand):
        spec = command.spec
        return replace(patch, spec=None if spec is None or spec.is_empty() else spec)
    return replace(patch, policy=patch_policy(resolve(global_config, request, patch).policy, command))


def check_global(config: Configuration, shape: ModelShape, named: dict[str, np.ndarray] | None) -> None:
    """Compile a global configuration for both phases, as the workers will (its policy admitted); raises
    :class:`~dynsteer.spec.SteeringValidationError` naming the bad field."""
    effective = resolve(config)
    for phase in ("prefill", "decode"):
        compile_phase(effective.phase_specs(phase), phase, shape, named, effective.policy_entry)
