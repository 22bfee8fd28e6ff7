"""Sync-tier controllers: hysteresis, one-step latency, EMA, PID on a simulated plant, budgets, determinism."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from dynsteer.controllers import (PID, Budget, EMALatch, StepObservation, SyncController, ThresholdLatch,
                                  applied_scales, make_controller, run_controller)
from dynsteer.policy import SyncControllerSpec


def test_latch_hysteresis_holds_between_thresholds() -> None:
    c = ThresholdLatch(on=1.0, off=0.0, scale=3.0)
    scores = [0.5, 0.99, 1.0, 0.5, 0.01, 0.5, 0.0, 0.5, 0.99, 2.0, -5.0]
    out = run_controller(c, scores)
    #        below on  below on  on!  hold  hold  hold  off!  hold(off) hold(off)  on!  off!
    assert out == [0.0, 0.0, 3.0, 3.0, 3.0, 3.0, 0.0, 0.0, 0.0, 3.0, 0.0]
    # the same score (0.5) gives 0 or 3 depending on history: that is the hysteresis
    assert {out[i] for i, s in enumerate(scores) if s == 0.5} == {0.0, 3.0}


def test_latch_rejects_bad_params() -> None:
    with pytest.raises(ValueError, match="on ≥ off"):
        ThresholdLatch(on=0.0, off=1.0, scale=1.0)
    with pytest.raises(ValueError, match="scale"):
        ThresholdLatch(on=1.0, off=0.0, scale=math.nan)


def test_latency_is_exactly_one_step() -> None:
    """``run_controller``'s out[t] uses scores[0..t]; it steers step t+1 (``applied_scales``)."""
    c = ThresholdLatch(on=1.0, off=0.5, scale=1.0)
    scores = [0.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0]
    trigger = 3
    out = run_controller(c, scores)
    applied = applied_scales(c, scores)
    assert out.index(1.0) == trigger  # decided right after observing the trigger token
    assert applied.index(1.0) == trigger + 1  # first steered token is the next one
    assert applied == [0.0] + out[:-1]
    assert applied[0] == 0.0  # nothing steers the first step
    # causality: out[t] does not depend on future scores
    for t in range(len(scores)):
        changed = scores[:t + 1] + [100.0] * (len(scores) - t - 1)
        assert run_controller(c, changed)[:t + 1] == out[:t + 1]


def test_ema_smoothing_numerically() -> None:
    alpha = 0.25
    c = EMALatch(alpha=alpha, on=1.5, off=0.5, scale=2.0)
    scores = [0.0, 4.0, 4.0, -1.0, 3.0, 0.0, 0.0, 0.0]
    ema, state = [], c.initial_state()
    for t, s in enumerate(scores):
        state, _ = c.on_step(state, StepObservation(step=t, position=t, score=s, gate=0.0))
        ema.append(state.ema)
    expected = [scores[0]]
    for s in scores[1:]:
        expected.append(alpha * s + (1 - alpha) * expected[-1])
    np.testing.assert_allclose(ema, expected, rtol=0, atol=1e-15)
    assert expected[:3] == [0.0, 1.0, 1.75]  # the first value initialises it
    out = run_controller(c, scores)
    assert out == [2.0 if (e >= 1.5 or (i and out[i - 1] and e > 0.5)) else 0.0 for i, e in enumerate(expected)]
    # a single spike is filtered out where the raw latch would fire
    spike = [0.0] * 5 + [3.0] + [0.0] * 5
    assert max(run_controller(c, spike)) == 0.0
    assert max(run_controller(ThresholdLatch(on=1.5, off=0.5, scale=2.0), spike)) == 2.0
    # alpha=1 is the plain latch
    assert run_controller(EMALatch(alpha=1.0, on=1.5, off=0.5, scale=2.0), scores) == run_controller(
        ThresholdLatch(on=1.5, off=0.5, scale=2.0), scores)
    with pytest.raises(ValueError, match="alpha"):
        EMALatch(alpha=0.0, on=1.0, off=0.0, scale=1.0)


def _simulate(c: SyncController, s0: float, gain: float, drift: float, steps: int):
    """Closed loop: score_{t+1} = score_t − gain·scale_t + drift, scale_t decided after seeing score_t."""
    state, score, scores, scales = c.initial_state(), s0, [], []
    for t in range(steps):
        scores.append(score)
        state, scale = c.on_step(state, StepObservation(step=t, position=t, score=score, gate=0.0))
        scales.append(scale)
        score = score - gain * scale + drift
    return scores, scales, state


def test_pid_converges_on_simulated_plant() -> None:
    c = PID(target=1.0, kp=0.3, ki=0.2, kd=0.05, min_scale=0.0, max_scale=2.0)
    scores, scales, state = _simulate(c, s0=3.0, gain=1.0, drift=0.5, steps=80)
    assert abs(scores[-1] - 1.0) < 1e-3  # reaches the target despite the drift (integral action)
    assert abs(scales[-1] - 0.5) < 1e-3  # steady state: gain·scale = drift
    assert all(0.0 <= s <= 2.0 for s in scales)
    # without the integral a proportional controller keeps a steady-state error
    p_scores, _, _ = _simulate(PID(target=1.0, kp=0.3, ki=0.0, kd=0.0, max_scale=2.0), 3.0, 1.0, 0.5, 80)
    assert p_scores[-1] - 1.0 > 0.5


def test_pid_sign_and_saturation() -> None:
    c = PID(target=0.0, kp=1.0, ki=0.0, kd=0.0, min_scale=-0.5, max_scale=1.0)
    assert run_controller(c, [0.3, 5.0, -0.2, -9.0]) == pytest.approx([0.3, 1.0, -0.2, -0.5])
    d = PID(target=0.0, kp=0.0, ki=0.0, kd=1.0, min_scale=-10.0, max_scale=10.0)
    assert run_controller(d, [1.0, 3.0, 2.0]) == pytest.approx([0.0, 2.0, -1.0])  # Δe, 0 on the first step
    with pytest.raises(ValueError, match="min_scale"):
        PID(target=0.0, kp=1.0, ki=0.0, kd=0.0, min_scale=1.0, max_scale=0.0)


def test_pid_anti_windup() -> None:
    target, kp, ki = 1.0, 0.1, 0.1
    c = PID(target=target, kp=kp, ki=ki, kd=0.0, min_scale=0.0, max_scale=1.0)
    scores = [10.0] * 200 + [0.0] * 5
    out = run_controller(c, scores)
    assert all(s == 1.0 for s in out[20:200])  # saturated while the score is far above target
    assert out[200] < 0.05  # leaves saturation as soon as the error changes sign
    state = c.initial_state()
    for t, s in enumerate(scores[:200]):
        state, _ = c.on_step(state, StepObservation(step=t, position=t, score=s, gate=0.0))
    assert state.integral <= (1.0 - kp * (10.0 - target)) / ki + (10.0 - target)  # bounded, not 200·9
    # an integrator without anti-windup would stay saturated for hundreds of steps; check the unsaturated range
    # still integrates normally
    small = run_controller(PID(target=0.0, kp=0.0, ki=0.1, kd=0.0, max_scale=10.0), [1.0] * 5)
    assert small == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    # saturated plant: the output clips at max_scale and the integral does not grow
    _, scales, st = _simulate(PID(target=1.0, kp=0.3, ki=0.2, kd=0.0, max_scale=0.3), 3.0, 1.0, 0.5, 50)
    assert max(scales) == 0.3 and st.integral == 0.0


def test_budget_stops_after_n_steered_tokens() -> None:
    inner = ThresholdLatch(on=1.0, off=0.0, scale=1.0)
    scores = [0.0, 2.0, 2.0, -1.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    unlimited = run_controller(inner, scores)
    out = run_controller(Budget(inner, max_steered_tokens=3), scores)
    assert sum(1 for s in unlimited if s) == 7
    assert sum(1 for s in out if s) == 3
    assert out == [0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # zeros in between do not count
    assert run_controller(Budget(inner, 0), scores) == [0.0] * len(scores)
    assert run_controller(Budget(inner, 100), scores) == unlimited
    with pytest.raises(ValueError, match="max_steered_tokens"):
        Budget(inner, -1)


def test_nonfinite_score_is_ignored() -> None:
    for c in (ThresholdLatch(on=1.0, off=0.0, scale=1.0), EMALatch(alpha=0.5, on=1.0, off=0.0, scale=1.0),
              PID(target=0.0, kp=0.5, ki=0.1, kd=0.0)):
        out = run_controller(c, [2.0, math.nan, math.inf, 2.0])
        assert out[1] == out[2] == out[0] and all(math.isfinite(s) for s in out)


def test_determinism_and_immutability() -> None:
    rng = np.random.default_rng(0)
    scores = list(rng.normal(1.0, 1.0, 300))
    controllers = [ThresholdLatch(on=1.5, off=0.5, scale=1.0), EMALatch(alpha=0.2, on=1.2, off=0.8, scale=2.0),
                   PID(target=0.5, kp=0.4, ki=0.05, kd=0.1), Budget(EMALatch(alpha=0.3, on=1.0, off=0.5, scale=1.0),
                                                                   25)]
    for c in controllers:
        a, b = run_controller(c, scores), run_controller(c, scores)
        assert a == b  # bit-identical
        state0 = c.initial_state()
        s1, _ = c.on_step(state0, StepObservation(step=0, position=0, score=3.0, gate=1.0))
        assert state0 == c.initial_state() and s1 is not state0  # old state untouched
        assert dataclasses.is_dataclass(state0) and state0.__dataclass_params__.frozen
        with pytest.raises(dataclasses.FrozenInstanceError):
            c.on_step = None  # type: ignore[misc]
        assert isinstance(c, SyncController)
    # the same state and observation give the same decision (as on every TP rank)
    c = controllers[2]
    st = c.initial_state()
    for s in scores[:10]:
        st, _ = c.on_step(st, StepObservation(step=0, position=0, score=s, gate=0.0))
    obs = StepObservation(step=10, position=10, score=2.0, gate=0.5)
    assert c.on_step(st, obs) == c.on_step(st, obs)


def test_make_controller_each_kind() -> None:
    latch = SyncControllerSpec(kind="latch", on=1.0, off=0.5, scale=2.0)
    ema = SyncControllerSpec(kind="ema_latch", alpha=0.3, on=1.0, off=0.5, scale=2.0)
    pid = SyncControllerSpec(kind="pid", target=0.5, kp=1.0, ki=0.1, kd=0.2, max_scale=3.0)
    budget = SyncControllerSpec(kind="budget", inner=ema, max_steered_tokens=7)
    assert make_controller(latch) == ThresholdLatch(on=1.0, off=0.5, scale=2.0)
    assert make_controller(ema) == EMALatch(alpha=0.3, on=1.0, off=0.5, scale=2.0)
    assert make_controller(pid) == PID(target=0.5, kp=1.0, ki=0.1, kd=0.2, min_scale=0.0, max_scale=3.0)
    assert make_controller(budget) == Budget(EMALatch(alpha=0.3, on=1.0, off=0.5, scale=2.0), 7)
    scores = [0.0, 2.0, 2.0, 0.0]
    for spec in (latch, ema, pid, budget):
        c = make_controller(spec)
        assert isinstance(c, SyncController)
        assert len(run_controller(c, scores)) == len(scores)
    # a spec survives JSON and builds the same controller
    assert make_controller(SyncControllerSpec.model_validate_json(budget.model_dump_json())) == make_controller(budget)


def test_user_controller_protocol() -> None:
    @dataclasses.dataclass(frozen=True)
    class GateFollower:
        """Steers the next token by the last gate: a minimal user controller."""

        def initial_state(self) -> tuple[()]:
            return ()

        def on_step(self, state: tuple[()], obs: StepObservation) -> tuple[tuple[()], float]:
            return state, obs.gate

    c = GateFollower()
    assert isinstance(c, SyncController)
    assert run_controller(c, [0.0, 0.0, 0.0], gates=[0.1, 0.9, 0.0]) == [0.1, 0.9, 0.0]
    assert applied_scales(c, [0.0, 0.0], gates=[0.7, 0.2]) == [0.0, 0.7]
    assert applied_scales(c, []) == []
