"""DynamicSteeringPolicy schema and validation; a monitor's gate against the in-graph monitor's torch reference (no
engine)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import yaml
from pydantic import ValidationError

from dynsteer.kernels import SiteTables, steer_site_dyn_reference
from dynsteer.policy import Action, DynamicSteeringPolicy, ProbeGate, Rule, SyncControllerSpec
from dynsteer.probes import save_probe
from dynsteer.spec import ModelShape, SteeringValidationError

H = 16
SHAPE = ModelShape(num_layers=6, hidden_size=H)


def _vec(seed: int, n: int = H) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _policy(**overrides) -> DynamicSteeringPolicy:
    kw = dict(
        monitors=[ProbeGate(name="tox", layer=2, site="post_attn", direction=_vec(0), sharpness=3.5,
                          threshold=0.1234567),
                  ProbeGate(name="other", layer=1, probe_file="probe.safetensors")],
        rules=[Rule(monitor="tox", scope="rest_of_request", gate_floor=0.2,
                    actions=[Action(kind="add", layer=2, site="post_block", vector=_vec(1), scale=-1.5),
                             Action(kind="clamp", layer=4, vector="refusal", lo=-1.0, hi=2.0, strength=0.5),
                             Action(kind="ablate", layer=5, vector=_vec(2))]),
               Rule(monitor="other", actions=[Action(kind="add", layer=3, vector="refusal")])],
        controller=SyncControllerSpec(kind="budget", monitor="tox", max_steered_tokens=64,
                                      inner=SyncControllerSpec(kind="ema_latch", alpha=0.3, on=1.0, off=0.25,
                                                               scale=2.0)),
    )
    kw.update(overrides)
    return DynamicSteeringPolicy(**kw)


def _assert_same(a: DynamicSteeringPolicy, b: DynamicSteeringPolicy) -> None:
    assert a == b
    assert a.model_dump(mode="json") == b.model_dump(mode="json")
    assert np.array_equal(a.monitors[0].direction, b.monitors[0].direction)
    for ra, rb in zip(a.rules, b.rules):
        for x, y in zip(ra.actions, rb.actions):
            if isinstance(x.vector, str):
                assert x.vector == y.vector
            else:
                assert x.vector.dtype == y.vector.dtype == np.float32
                assert x.vector.tobytes() == y.vector.tobytes()  # bit-exact


# ------------------------------------------------------------------------------------------------ round trips
def test_yaml_round_trip_exact() -> None:
    p = _policy()
    text = p.to_yaml()
    loaded = yaml.safe_load(text)
    assert set(loaded["monitors"][0]["direction"]) == {"b64"}  # vectors packed, not float lists
    assert set(loaded["rules"][0]["actions"][0]["vector"]) == {"b64"}
    back = DynamicSteeringPolicy.from_yaml(text)
    _assert_same(p, back)
    assert back.monitors[0].threshold == 0.1234567 and back.version == 1


def test_json_round_trip_exact() -> None:
    p = _policy()
    raw = p.to_json()
    assert isinstance(json.loads(raw)["monitors"][0]["direction"]["b64"], str)
    _assert_same(p, DynamicSteeringPolicy.from_json(raw))
    _assert_same(p, DynamicSteeringPolicy.model_validate(json.loads(raw)))


def test_frozen_and_extra_forbidden() -> None:
    p = _policy()
    with pytest.raises(ValidationError):
        p.version = 2  # type: ignore[misc]
    with pytest.raises(ValidationError, match="bogus"):
        DynamicSteeringPolicy.model_validate({**p.model_dump(mode="json"), "bogus": 1})
    with pytest.raises(ValidationError, match="version"):
        DynamicSteeringPolicy.model_validate({**p.model_dump(mode="json"), "version": 2})


# ------------------------------------------------------------------------------------------------ validation
def _error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def test_unknown_monitor_names_field() -> None:
    msg = _error(lambda: _policy(rules=[Rule(monitor="tox", actions=[Action(kind="add", layer=3, vector="v")]),
                                        Rule(monitor="nope", actions=[Action(kind="add", layer=3, vector="v")])]))
    assert "rules[1].monitor" in msg and "nope" in msg


def test_action_before_monitor_layer_names_field() -> None:
    rule = Rule(monitor="tox", actions=[Action(kind="add", layer=3, vector="v"),
                                        Action(kind="add", layer=1, vector="v")])
    msg = _error(lambda: _policy(rules=[rule]))
    assert "rules[0].actions[1].layer" in msg
    # same layer, earlier site than the monitor's (post_attn): the gate does not exist yet
    rule = Rule(monitor="tox", actions=[Action(kind="add", layer=2, site="pre_attn", vector="v")])
    assert "rules[0].actions[0].site" in _error(lambda: _policy(rules=[rule]))
    # same layer and site is allowed (the monitor reads the residual before the action)
    _policy(rules=[Rule(monitor="tox", actions=[Action(kind="add", layer=2, site="post_attn", vector="v")])])


def test_monitor_forms() -> None:
    both = _error(lambda: ProbeGate(name="m", layer=0, probe_file="p.safetensors", direction=_vec(0), sharpness=1.0,
                                  threshold=0.0))
    assert "probe_file" in both and "not both" in both
    neither = _error(lambda: ProbeGate(name="m", layer=0))
    assert "probe_file" in neither and "direction" in neither
    partial = _error(lambda: ProbeGate(name="m", layer=0, direction=_vec(0), sharpness=1.0))
    assert "threshold" in partial


def test_field_errors() -> None:
    assert re.search(r"scope", _error(lambda: Rule(monitor="m", scope="forever",
                                                   actions=[Action(kind="add", layer=0, vector="v")])))
    assert "threshold" in _error(lambda: ProbeGate(name="m", layer=0, direction=_vec(0), sharpness=1.0,
                                                 threshold=float("nan")))
    assert "sharpness" in _error(lambda: ProbeGate(name="m", layer=0, direction=_vec(0), sharpness=0.0,
                                                 threshold=0.0))
    assert "direction" in _error(lambda: ProbeGate(name="m", layer=0, direction=np.zeros(H), sharpness=1.0,
                                                 threshold=0.0))
    assert "actions" in _error(lambda: Rule(monitor="m", actions=[]))
    assert "lo" in _error(lambda: Action(kind="clamp", layer=0, vector="v", lo=2.0, hi=1.0))
    assert "lo/hi" in _error(lambda: Action(kind="clamp", layer=0, vector="v"))
    assert "lo/hi" in _error(lambda: Action(kind="add", layer=0, vector="v", hi=1.0))
    assert "scale" in _error(lambda: Action(kind="ablate", layer=0, vector="v", scale=2.0))
    assert "scale" in _error(lambda: Action(kind="add", layer=0, vector="v", scale=float("inf")))
    assert "gate_floor" in _error(lambda: Rule(monitor="m", gate_floor=1.5,
                                               actions=[Action(kind="add", layer=0, vector="v")]))
    assert "monitors[1].name" in _error(lambda: _policy(monitors=[
        ProbeGate(name="tox", layer=0, probe_file="a"), ProbeGate(name="tox", layer=0, probe_file="b")], rules=[],
        controller=None))


def test_controller_spec_validation() -> None:
    assert "off" in _error(lambda: SyncControllerSpec(kind="latch", on=1.0, scale=1.0))
    assert "off" in _error(lambda: SyncControllerSpec(kind="latch", on=0.0, off=1.0, scale=1.0))
    assert "kp" in _error(lambda: SyncControllerSpec(kind="latch", on=1.0, off=0.0, scale=1.0, kp=1.0))
    assert "alpha" in _error(lambda: SyncControllerSpec(kind="ema_latch", alpha=0.0, on=1.0, off=0.0, scale=1.0))
    assert "min_scale" in _error(lambda: SyncControllerSpec(kind="pid", target=0.0, kp=1.0, ki=0.0, kd=0.0,
                                                            min_scale=2.0, max_scale=1.0))
    assert "inner" in _error(lambda: SyncControllerSpec(kind="budget", max_steered_tokens=3))
    assert "max_steered_tokens" in _error(lambda: SyncControllerSpec(
        kind="budget", max_steered_tokens=-1, inner=SyncControllerSpec(kind="latch", on=1.0, off=0.0, scale=1.0)))
    assert "target" in _error(lambda: SyncControllerSpec(kind="pid", target=float("nan"), kp=1.0, ki=0.0, kd=0.0))
    # several monitors: the controller must say which one feeds it
    latch = SyncControllerSpec(kind="latch", on=1.0, off=0.0, scale=1.0)
    assert "controller.monitor" in _error(lambda: _policy(controller=latch))
    assert "controller.monitor" in _error(lambda: _policy(controller=latch.model_copy(update={"monitor": "zzz"})))
    single = _policy(monitors=_policy().monitors[:1], rules=_policy().rules[:1], controller=latch)
    assert single.controller_monitor().name == "tox"


def test_check_against_model_shape(tmp_path) -> None:
    named = {"refusal": _vec(9)}
    inline = _policy(monitors=_policy().monitors[:1], rules=_policy().rules[:1],
                     controller=_policy().controller)
    inline.check(SHAPE, named)  # fits

    def check_msg(policy: DynamicSteeringPolicy, shape: ModelShape = SHAPE, names=named) -> str:
        with pytest.raises(SteeringValidationError) as info:
            policy.check(shape, names)
        return str(info.value)

    assert "monitors[0].direction" in check_msg(inline, ModelShape(num_layers=6, hidden_size=H + 1))
    wrong_size = DynamicSteeringPolicy(monitors=inline.monitors, rules=[
        Rule(monitor="tox", actions=[Action(kind="add", layer=3, vector=_vec(1, H + 2))])])
    assert "rules[0].actions[0].vector" in check_msg(wrong_size)
    assert "rules[0].actions[1].vector" in check_msg(inline, names={})  # "refusal" not registered
    assert "rules[0].actions[2].layer" in check_msg(inline, ModelShape(num_layers=5, hidden_size=H))
    assert "monitors[0].layer" in check_msg(inline, ModelShape(num_layers=6, hidden_size=H, layers=(3, 4, 5)))
    assert "monitors[0].site" in check_msg(inline, ModelShape(num_layers=6, hidden_size=H, sites=("post_block",)))
    assert "rules[0].actions[2].vector" in check_msg(DynamicSteeringPolicy(monitors=inline.monitors, rules=[
        Rule(monitor="tox", actions=[Action(kind="add", layer=3, vector="refusal"),
                                     Action(kind="add", layer=3, vector=np.zeros(H)),
                                     Action(kind="ablate", layer=3, vector=np.zeros(H))])]))
    # NaN inside a named vector is caught by check
    assert "rules[0].actions[1].vector" in check_msg(inline, names={"refusal": np.full(H, np.nan, np.float32)})
    # a probe-file monitor is loaded and checked
    missing = DynamicSteeringPolicy(monitors=[ProbeGate(name="f", layer=1, probe_file=str(tmp_path / "none"))])
    assert "monitors[0].probe_file" in check_msg(missing)
    path = save_probe(tmp_path / "p.safetensors", _vec(3, H + 1), 0.5, model_id="m", layer=1)
    wrong = DynamicSteeringPolicy(monitors=[ProbeGate(name="f", layer=1, probe_file=str(path))])
    assert "monitors[0].direction" in check_msg(wrong)


# ------------------------------------------------------------------------------------------------ probe files
@pytest.mark.parametrize("standardized", [False, True])
def test_monitor_from_probe_file_matches_predict_proba(tmp_path, standardized: bool) -> None:
    from dynsteer.probes import load_probe

    rng = np.random.default_rng(0)
    w, b = rng.standard_normal(H), 0.7
    kw = dict(mean=rng.standard_normal(H), scale=rng.uniform(0.5, 2.0, H)) if standardized else {}
    path = save_probe(tmp_path / "p.safetensors", w, b, model_id="m", layer=3, site="post_attn", **kw)
    probe = load_probe(path)
    mon = ProbeGate.from_probe_file(path, name="m")
    assert (mon.layer, mon.site, mon.probe_file) == (3, "post_attn", None)
    X = rng.standard_normal((200, H)) * 2.0  # float64 inputs
    expected = probe.predict_proba(X)[:, 1]
    assert expected.min() < 0.05 and expected.max() > 0.95  # covers the whole sigmoid
    np.testing.assert_allclose(mon.gate(X), expected, atol=1e-6, rtol=0)
    # the file form resolves to the same monitor; a layer mismatch is refused
    file_mon = ProbeGate(name="m", layer=3, site="post_attn", probe_file=str(path))
    assert file_mon.resolve() == mon
    np.testing.assert_allclose(file_mon.gate(X), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="layer 3"):
        ProbeGate(name="m", layer=4, site="post_attn", probe_file=str(path)).resolve()
    # and the in-graph monitor (the dynamic op's torch reference, decode tokens) agrees within float32 accuracy
    np.testing.assert_allclose(_in_graph_gate(mon, torch.from_numpy(X.astype(np.float32))), expected, atol=1e-5,
                               rtol=0)


def _in_graph_gate(mon: ProbeGate, x: torch.Tensor) -> np.ndarray:
    """The gates ``steer_site_dyn_reference`` computes for ``mon`` (row 1, gate slot 0, floor 0) on decode tokens
    ``x`` [T, H] (the host stages gate_mul 1, gate_add 0 for them)."""
    n = x.shape[0]
    rows = lambda *shape: torch.zeros(2, *shape)  # noqa: E731
    probe, sharp, thresh = rows(1, H), rows(1), rows(1)
    probe[1, 0], sharp[1, 0], thresh[1, 0] = torch.from_numpy(mon.direction), mon.sharpness, mon.threshold
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    gates = torch.zeros(1, n)
    tables = SiteTables(rows(H), rows(0, H), rows(0), rows(0), rows(0), i32(4, 4), torch.zeros(2, 0, dtype=torch.int32),
                        i32(0, 1), probe, sharp, thresh, rows(1), i32(0, 0), rows(1, H), torch.ones(1, n),
                        torch.zeros(1, n), gates, torch.zeros(1, n))
    steer_site_dyn_reference(x, None, torch.ones(n, dtype=torch.int32), tables)
    return gates[0].numpy()


def test_controller_thresholds_in_probability_units_convert_through_the_monitor_gate():
    import math

    from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule, SyncControllerSpec
    from dynsteer.controllers.sync import make_controller

    mon = ProbeGate(name="m", layer=1, direction=[1.0, 0.0], sharpness=2.0, threshold=1.0)
    rule = Rule(monitor="m", actions=[Action(kind="add", layer=1, vector=[0.0, 1.0])])
    inner = SyncControllerSpec(kind="ema_latch", alpha=0.5, on=0.9, off=0.5, scale=1.0, units="probability")
    pol = DynamicSteeringPolicy(monitors=[mon], rules=[rule], controller=SyncControllerSpec(
        kind="budget", max_steered_tokens=4, inner=inner))
    with pytest.raises(ValueError, match="controller.units"):
        make_controller(pol.controller.inner)  # unresolved probabilities are never read as scores
    got = pol.resolved().controller.inner
    assert got.units == "score" and got.off == pytest.approx(1.0)  # p = 0.5 is the monitor's threshold
    assert got.on == pytest.approx(1.0 + math.log(9.0) / 2.0)
    assert mon.gate([got.on, 0.0]) == pytest.approx(0.9)  # the converted score is where the gate reads 0.9
    assert pol.resolved().resolved() == pol.resolved()  # idempotent
    bad = pol.model_copy(update={"controller": SyncControllerSpec(kind="latch", on=1.5, off=0.5, scale=1.0,
                                                                  units="probability")})
    with pytest.raises(ValueError, match=r"controller\.on: 1\.5 is not a probability"):
        bad.resolved()


def test_an_engine_refuses_a_dose_guardrail_it_cannot_enforce():
    from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule
    from dynsteer.dose import enforce_dose_limit
    from dynsteer.policy import admit_policy

    mon = ProbeGate(name="m", layer=1, direction=[1.0, 0.0], sharpness=2.0, threshold=1.0)
    pol = DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[
        Action(kind="add", layer=1, vector=[0.0, 1.0], scale=4.0)])], max_relative_dose=0.5)
    with pytest.raises(ValueError, match=r"policy\.max_relative_dose: enforced by the caller"):
        admit_policy(pol, {}, {})
    from dynsteer.policy import RelativeDoseLimit

    roomy = pol.model_copy(update={"max_relative_dose": RelativeDoseLimit(limit=100.0, mode="clip")})
    sent, _ = enforce_dose_limit(roomy, {(1, "post_block"): 10.0})
    assert sent.max_relative_dose is None and admit_policy(sent, {}, {}).rules == pol.rules
