"""Custom sync controllers for tests and examples (registered by name in ``DynsteerConfig.controllers``)."""

from __future__ import annotations

import math
from typing import Any


class EveryOther:
    """Steer at ``scale`` on every other step (pure; the state is the step parity)."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def initial_state(self) -> int:
        return 0

    def on_step(self, state: int, obs: Any) -> tuple[int, float]:
        return state + 1, self.scale if state % 2 == 0 else 0.0


class NanAfter:
    """A misbehaving controller: scale 1 for ``steps`` steps, then NaN (the engine must stop its request)."""

    def __init__(self, steps: int = 2) -> None:
        self.steps = int(steps)

    def initial_state(self) -> int:
        return 0

    def on_step(self, state: int, obs: Any) -> tuple[int, float]:
        return state + 1, (1.0 if state < self.steps else math.nan)


class Halver:
    """``gain · score``, clipped to ``[-1, 1]``."""

    def __init__(self, gain: float = 0.5) -> None:
        self.gain = float(gain)

    def initial_state(self) -> int:
        return 0

    def on_step(self, state: int, obs: Any) -> tuple[int, float]:
        return state, max(-1.0, min(1.0, self.gain * obs.score))
