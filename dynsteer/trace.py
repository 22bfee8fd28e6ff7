"""What dynamic steering did to one request: per generated token, each gate slot's score, gate and applied gate.

Returned with the outputs as ``output.trace`` by :meth:`dynsteer.Steerer.generate` when a policy is active.

Example:
    >>> t = DynamicTrace(tag="a", monitors=["m"], scopes=["this_token"], position=[5, 6],
    ...                  score=[[0.1], [2.0]], gate=[[0.2], [0.9]], applied=[[0.2], [0.9]], scale=[1.0, 1.0])
    >>> t.fired("m").tolist()
    [False, True]
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict


class DynamicTrace(BaseModel):
    """One request's dynamic-steering trace (one row per generated token whose forward ran).

    Attributes:
        tag: the request's payload tag.
        monitors: the monitor read by each gate slot (one slot per rule, then the controller's monitor when no
            rule reads it).
        scopes: each slot's rule scope (``"monitor"``: a controller-only slot).
        position: sequence position of each traced token (the token fed to that step's forward).
        score: ``[tokens][slots]`` the monitor's ``x·probe``.
        gate: ``[tokens][slots]`` ``σ(sharpness·(score − threshold))`` (0 below the rule's floor).
        applied: ``[tokens][slots]`` the gate that multiplied the slot's actions (scope and controller applied).
        scale: the sync controller's ``dyn_scale`` in effect at each token (1 without a controller).
    """

    model_config = ConfigDict(frozen=True)

    tag: str
    monitors: list[str]
    scopes: list[str]
    position: list[int]
    score: list[list[float]]
    gate: list[list[float]]
    applied: list[list[float]]
    scale: list[float]

    def _slot(self, monitor: str | int) -> int:
        return monitor if isinstance(monitor, int) else self.monitors.index(monitor)

    def scores(self, monitor: str | int = 0) -> np.ndarray:
        """Scores of one slot (by monitor name or slot index), one per traced token."""
        return np.asarray(self.score, np.float64).reshape(len(self.position), -1)[:, self._slot(monitor)]

    def gates(self, monitor: str | int = 0) -> np.ndarray:
        return np.asarray(self.gate, np.float64).reshape(len(self.position), -1)[:, self._slot(monitor)]

    def applied_gates(self, monitor: str | int = 0) -> np.ndarray:
        return np.asarray(self.applied, np.float64).reshape(len(self.position), -1)[:, self._slot(monitor)]

    def fired(self, monitor: str | int = 0, at: float = 0.5) -> np.ndarray:
        """Tokens whose gate reached ``at``."""
        return self.gates(monitor) >= at

    def __len__(self) -> int:
        return len(self.position)
