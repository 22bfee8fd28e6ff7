"""Rules: a monitor's gate switching a group of actions, when it acts, and when it aborts the request."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, StrictBool, model_validator

from dynsteer.policy._actions import Action
from dynsteer.policy._base import FrozenModel
from dynsteer.spec import Real

Scope = Literal["this_token", "next_step", "rest_of_request"]
"""When a rule's gate acts: the same token (in-graph), the next step, or from the first trigger to the end."""


class Rule(FrozenModel):
    """A monitor's gate switching a group of actions.

    Args:
        monitor: name of a monitor of the policy.
        actions: one or more actions.
        scope: ``this_token``, ``next_step`` or ``rest_of_request`` (see the module docstring).
        gate_floor: gate values below it count as 0, in ``[0, 1]``.
        enabled: ``False`` keeps computing the rule's gate (its trace and controller see it) but applies none of
            its actions and never aborts; a monitor's ``rule`` command switches it.
        abort: stop the request, with this reason, once the rule fires: at the first generated position where
            its gate reaches 0.5 (its monitor's score crosses the threshold; or ``gate_floor`` if higher). The
            gate is read back from the device, so the request finishes within two steps of that position, with
            the tokens generated until then and ``stop_reason = "dynsteer policy: rule <i> (monitor <name>):
            <abort>"``; its KV blocks stay shareable. A rule may abort without actions.
        condition: the name of a prompt-level monitor (``reads="prompt_last"``) whose held gate multiplies this
            rule's gate: the rule acts only in requests whose prompt the condition accepts (CAST-style), per token
            as its own monitor says.

    Example:
        >>> Rule(monitor="m", actions=[Action(kind="ablate", layer=5, vector="dir")]).scope
        'this_token'
        >>> Rule(monitor="m", abort="toxic continuation").actions
        ()
    """

    monitor: str = Field(min_length=1, max_length=128)
    actions: tuple[Action, ...] = ()
    scope: Scope = "this_token"
    gate_floor: Real = Field(default=0.0, ge=0.0, le=1.0)
    enabled: StrictBool = True
    abort: Optional[str] = Field(default=None, min_length=1, max_length=200)
    condition: Optional[str] = Field(default=None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _acts_or_aborts(self) -> "Rule":
        if not self.actions and self.abort is None:
            raise ValueError("actions: a rule needs at least one action, or an abort reason")
        if self.abort is not None and not self.abort.isprintable():
            raise ValueError("abort: the reason must be printable text")
        return self

