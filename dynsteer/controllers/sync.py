"""The sync actuator tier's controllers (architecture §4): pure, deterministic per-request state machines.

Contract:
    * A controller is built once from its spec (:func:`make_controller`) and holds only immutable parameters.
    * Its per-request state is an immutable value (a frozen dataclass) made by ``initial_state()``.
    * Every engine step, for every live request, ``on_step(state, obs) -> (new_state, scale)`` is called once on
      EVERY tensor-parallel rank with rank-identical inputs. ``obs`` is a :class:`StepObservation` carrying the
      in-graph monitor's score and gate of the token computed in that step.
    * ``scale`` (``dyn_scale`` of architecture §3) is applied at the NEXT step: the latency is exactly one step. The
      scale returned after observing step ``t`` reflects the scores of steps ``0..t`` and steers the token of step
      ``t + 1``; step 0 runs with the initial scale 0.
    * Nothing is mutated and nothing depends on wall-clock time, randomness or rank, so identical inputs give
      bit-identical decisions on every rank. No torch, no vLLM: plain Python floats.
    * A non-finite score (NaN/inf) is ignored: the state is unchanged and the previous scale is repeated.

User controllers implement the :class:`SyncController` protocol under the same rules.

Example:
    >>> from dynsteer.controllers.sync import ThresholdLatch, run_controller
    >>> run_controller(ThresholdLatch(on=1.0, off=0.0, scale=2.0), [0.5, 1.2, 0.5, -0.1, 0.5])
    [0.0, 2.0, 2.0, 0.0, 0.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Generic, Protocol, Sequence, TypeVar, runtime_checkable

__all__ = ["Budget", "BudgetState", "EMALatch", "EMALatchState", "LatchState", "PID", "PIDState", "StepObservation",
           "SyncController", "ThresholdLatch", "applied_scales", "make_controller", "run_controller"]

S = TypeVar("S")


@dataclass(frozen=True)
class StepObservation:
    """What the sync tier sees of one request after one engine step.

    Attributes:
        step: index of the engine step within the request's decode (0 = the first generated token).
        position: the token's position in the sequence.
        score: the in-graph monitor's ``x·probe`` for the token just computed.
        gate: the in-graph monitor's gate for that token (0 for prefill tokens).
    """

    step: int
    position: int
    score: float
    gate: float


@runtime_checkable
class SyncController(Protocol[S]):
    """What a sync controller implements (built-ins and user controllers alike).

    Implementations must be pure: ``on_step`` may only read its arguments and the controller's immutable
    parameters, and must return a new state instead of mutating the old one. Its output is the steering scale for
    the request's next step.
    """

    def initial_state(self) -> S:
        """The state of a request that has not been observed yet (its scale is 0)."""
        ...

    def on_step(self, state: S, obs: StepObservation) -> tuple[S, float]:
        """Observe one step; return the new state and the scale to apply at the next step."""
        ...


def _check_finite(**values: float) -> None:
    for name, v in values.items():
        if not math.isfinite(v):
            raise ValueError(f"{name} must be finite, got {v}")


# ------------------------------------------------------------------------------------------------ threshold latch
@dataclass(frozen=True)
class LatchState:
    """``on``: whether the latch is engaged."""

    on: bool = False


def _latch(on_now: bool, value: float, on: float, off: float) -> bool:
    return value > off if on_now else value >= on


@dataclass(frozen=True)
class ThresholdLatch:
    """Hysteresis on the score: engages when ``score ≥ on``, disengages when ``score ≤ off``.

    Between the thresholds the latch holds its previous state.

    Args:
        on: engage threshold.
        off: release threshold, ``≤ on``.
        scale: output while engaged (0 otherwise).

    Example:
        >>> c = ThresholdLatch(on=2.0, off=1.0, scale=0.5)
        >>> s, out = c.on_step(c.initial_state(), StepObservation(step=0, position=10, score=2.5, gate=0.9))
        >>> s, out
        (LatchState(on=True), 0.5)
    """

    on: float
    off: float
    scale: float

    def __post_init__(self) -> None:
        _check_finite(on=self.on, off=self.off, scale=self.scale)
        if self.on < self.off:
            raise ValueError(f"hysteresis needs on ≥ off (on={self.on}, off={self.off})")

    def initial_state(self) -> LatchState:
        return LatchState()

    def on_step(self, state: LatchState, obs: StepObservation) -> tuple[LatchState, float]:
        if math.isfinite(obs.score):
            state = LatchState(_latch(state.on, obs.score, self.on, self.off))
        return state, (self.scale if state.on else 0.0)


# ------------------------------------------------------------------------------------------------ EMA latch
@dataclass(frozen=True)
class EMALatchState:
    """``ema``: smoothed score (``None`` before the first observation); ``on``: latch state."""

    ema: float | None = None
    on: bool = False


@dataclass(frozen=True)
class EMALatch:
    """A :class:`ThresholdLatch` on an exponential moving average of the score.

    ``ema_0 = score_0``; ``ema_t = alpha·score_t + (1 − alpha)·ema_{t−1}``.

    Args:
        alpha: smoothing weight of the newest score, in ``(0, 1]`` (1: no smoothing).
        on: engage threshold on the EMA.
        off: release threshold on the EMA, ``≤ on``.
        scale: output while engaged.

    Example:
        >>> run_controller(EMALatch(alpha=0.5, on=1.0, off=0.5, scale=1.0), [0.0, 2.0, 2.0, 0.0, 0.0])
        [0.0, 1.0, 1.0, 1.0, 0.0]
    """

    alpha: float
    on: float
    off: float
    scale: float

    def __post_init__(self) -> None:
        _check_finite(alpha=self.alpha, on=self.on, off=self.off, scale=self.scale)
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.on < self.off:
            raise ValueError(f"hysteresis needs on ≥ off (on={self.on}, off={self.off})")

    def initial_state(self) -> EMALatchState:
        return EMALatchState()

    def on_step(self, state: EMALatchState, obs: StepObservation) -> tuple[EMALatchState, float]:
        if math.isfinite(obs.score):
            ema = obs.score if state.ema is None else self.alpha * obs.score + (1.0 - self.alpha) * state.ema
            state = EMALatchState(ema=ema, on=_latch(state.on, ema, self.on, self.off))
        return state, (self.scale if state.on else 0.0)


# ------------------------------------------------------------------------------------------------ PID
@dataclass(frozen=True)
class PIDState:
    """``integral``: ∑e; ``prev_error``: last e (``None`` before the first step); ``scale``: last output."""

    integral: float = 0.0
    prev_error: float | None = None
    scale: float = 0.0


@dataclass(frozen=True)
class PID:
    """Drives the score toward ``target`` with a discrete PID (one step = one time unit).

    Sign convention: ``e = score − target``. A positive scale is assumed to push the score DOWN (the steering vector
    points away from the monitored behaviour), so a score above target (``e > 0``) asks for more steering and the
    output is ``clip(kp·e + ki·∑e + kd·Δe, min_scale, max_scale)`` with ``Δe = e_t − e_{t−1}``
    (0 at the first step).

    Anti-windup (conditional integration / clamping): the output is computed with the tentative integral
    ``∑e + e_t``; when it saturates AND the error pushes further into that saturation (``e > 0`` above ``max_scale``,
    ``e < 0`` below ``min_scale``) the output is clipped and the integral keeps its previous value. So the integral
    stays bounded while saturated and the output leaves saturation as soon as the error changes sign.

    Args:
        target: score set-point.
        kp: proportional gain.
        ki: integral gain.
        kd: derivative gain.
        min_scale: lower output bound (default 0: never steer the other way).
        max_scale: upper output bound (default 1).

    Example:
        >>> run_controller(PID(target=1.0, kp=0.5, ki=0.0, kd=0.0), [1.0, 2.0, 5.0, 0.0])
        [0.0, 0.5, 1.0, 0.0]
    """

    target: float
    kp: float
    ki: float
    kd: float
    min_scale: float = 0.0
    max_scale: float = 1.0

    def __post_init__(self) -> None:
        _check_finite(target=self.target, kp=self.kp, ki=self.ki, kd=self.kd, min_scale=self.min_scale,
                      max_scale=self.max_scale)
        if self.min_scale > self.max_scale:
            raise ValueError(f"min_scale ({self.min_scale}) must not exceed max_scale ({self.max_scale})")

    def initial_state(self) -> PIDState:
        return PIDState()

    def _clip(self, u: float) -> float:
        return min(max(u, self.min_scale), self.max_scale)

    def on_step(self, state: PIDState, obs: StepObservation) -> tuple[PIDState, float]:
        if not math.isfinite(obs.score):
            return state, state.scale
        e = obs.score - self.target
        de = 0.0 if state.prev_error is None else e - state.prev_error
        integral = state.integral + e
        u = self.kp * e + self.ki * integral + self.kd * de
        scale = self._clip(u)
        if (u > self.max_scale and e > 0) or (u < self.min_scale and e < 0):
            integral = state.integral  # saturated and winding further: hold the integral
        return PIDState(integral=integral, prev_error=e, scale=scale), scale


# ------------------------------------------------------------------------------------------------ budget
@dataclass(frozen=True)
class BudgetState(Generic[S]):
    """``inner``: the wrapped controller's state; ``steered``: steps with a non-zero output so far."""

    inner: Any
    steered: int = 0


@dataclass(frozen=True)
class Budget:
    """Caps how many tokens a controller may steer: after ``max_steered_tokens`` non-zero outputs, always 0.

    Each non-zero output steers exactly one token (the next step's), so the request gets at most
    ``max_steered_tokens`` steered tokens. Once exhausted the inner controller is no longer stepped.

    Args:
        inner: the wrapped controller.
        max_steered_tokens: the budget, ``≥ 0``.

    Example:
        >>> run_controller(Budget(ThresholdLatch(on=1.0, off=0.0, scale=1.0), 2), [2.0, 2.0, 2.0, 2.0])
        [1.0, 1.0, 0.0, 0.0]
    """

    inner: SyncController[Any]
    max_steered_tokens: int

    def __post_init__(self) -> None:
        if self.max_steered_tokens < 0:
            raise ValueError(f"max_steered_tokens must be ≥ 0, got {self.max_steered_tokens}")

    def initial_state(self) -> BudgetState[Any]:
        return BudgetState(inner=self.inner.initial_state())

    def on_step(self, state: BudgetState[Any], obs: StepObservation) -> tuple[BudgetState[Any], float]:
        if state.steered >= self.max_steered_tokens:
            return state, 0.0
        inner, scale = self.inner.on_step(state.inner, obs)
        return BudgetState(inner=inner, steered=state.steered + (scale != 0.0)), scale


# ------------------------------------------------------------------------------------------------ builders/drivers
def make_controller(spec: Any, registry: Any = None, max_scale: float = math.inf) -> SyncController[Any]:
    """Build the controller a :class:`dynsteer.policy.SyncControllerSpec` describes.

    Args:
        spec: the spec.
        registry: a :class:`dynsteer.controllers.registry.ControllerRegistry` for ``custom`` controllers (only
            names the operator registered can be built).
        max_scale: bound on a custom controller's output (the engine's ``max_dyn_scale``).

    Example:
        >>> from dynsteer.policy import SyncControllerSpec
        >>> make_controller(SyncControllerSpec(kind="pid", target=0.0, kp=1.0, ki=0.1, kd=0.0))
        PID(target=0.0, kp=1.0, ki=0.1, kd=0.0, min_scale=0.0, max_scale=1.0)
    """
    if getattr(spec, "units", "score") != "score":  # never read probabilities as projections
        raise ValueError("controller.units: 'probability' thresholds are converted when the policy is resolved "
                         "(DynamicSteeringPolicy.resolved); this spec was not")
    if spec.kind == "latch":
        return ThresholdLatch(on=spec.on, off=spec.off, scale=spec.scale)
    if spec.kind == "ema_latch":
        return EMALatch(alpha=spec.alpha, on=spec.on, off=spec.off, scale=spec.scale)
    if spec.kind == "pid":
        return PID(target=spec.target, kp=spec.kp, ki=spec.ki, kd=spec.kd,
                   min_scale=0.0 if spec.min_scale is None else spec.min_scale,
                   max_scale=1.0 if spec.max_scale is None else spec.max_scale)
    if spec.kind == "budget":
        return Budget(inner=make_controller(spec.inner, registry, max_scale),
                      max_steered_tokens=spec.max_steered_tokens)
    if spec.kind == "custom":
        if registry is None:
            raise ValueError(f"name: custom controller {spec.name!r} needs the engine's controller registry")
        return registry.build(spec.name, spec.options, max_scale)
    raise ValueError(f"unknown controller kind {spec.kind!r}")


def run_controller(controller: SyncController[Any], scores: Sequence[float], gates: Sequence[float] | None = None,
                   start_position: int = 0) -> list[float]:
    """Feed a score sequence through a controller; returns the scale it OUTPUTS after each step.

    ``out[t]`` is computed from ``scores[0..t]`` and is applied at step ``t + 1`` (one step of latency); use
    :func:`applied_scales` for the scale in effect at each step.

    Args:
        controller: the controller.
        scores: monitor score of each step's token.
        gates: monitor gate of each step's token (default 0 for every step).
        start_position: sequence position of step 0's token.
    """
    state = controller.initial_state()
    out: list[float] = []
    for t, score in enumerate(scores):
        gate = 0.0 if gates is None else float(gates[t])
        state, scale = controller.on_step(state, StepObservation(step=t, position=start_position + t,
                                                                 score=float(score), gate=gate))
        out.append(float(scale))
    return out


def applied_scales(controller: SyncController[Any], scores: Sequence[float], **kwargs: Any) -> list[float]:
    """The scale in effect at each step: 0 at step 0, then :func:`run_controller`'s output shifted by one.

    Example:
        >>> applied_scales(ThresholdLatch(on=1.0, off=0.0, scale=1.0), [0.0, 2.0, 2.0])
        [0.0, 0.0, 1.0]
    """
    out = run_controller(controller, scores, **kwargs)
    return [0.0] + out[:-1] if out else []
