"""Monitor commands: schema, field-naming rejections (fuzzed), policy patches, and their prefix-cache fold."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule
from dynsteer.commands import (RuleCommand, SteerCommand, ThresholdCommand, check_steer, decode_command,
                               encode_command, patch_policy, CommandEnvelope)
from dynsteer.engine.prefix_cache import ActedState
from dynsteer.spec import AddVector, SteeringSpec, SteeringValidationError

FIELDS = ("message", "v", "id", "monitor", "command")


def _ok(field_msg: str) -> bool:
    head = field_msg.split(":", 1)[0]
    return head.split(".", 1)[0].split("[", 1)[0] in FIELDS and ":" in field_msg


def test_valid_commands_round_trip():
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector=np.ones(8, np.float32), scale=2.0, tier="decode")])
    env = CommandEnvelope(id="c1", monitor="mon", command=SteerCommand(request="r1", spec=spec))
    back = decode_command(encode_command(env))
    assert back.command.request == "r1"
    np.testing.assert_array_equal(back.command.spec.vectors[0].vector, np.ones(8, np.float32))


@pytest.mark.parametrize("obj, field", [
    ({"id": "a", "monitor": "m", "command": {"op": "steer", "request": "r", "spec": {"vectors": [
        {"layer": 1, "vector": "v", "scale": "x"}]}}}, "command.spec.vectors[0].scale"),
    ({"id": "a", "monitor": "m", "command": {"op": "threshold", "request": "r", "monitor": "x",
                                              "threshold": float("nan")}}, "command.threshold"),
    ({"id": "a", "monitor": "m", "command": {"op": "rule", "request": "r", "rule": -1, "enabled": True}},
     "command.rule"),
    ({"id": "a", "monitor": "../etc", "command": {"op": "abort", "request": "r"}}, "monitor"),
    ({"id": "a", "monitor": "m", "command": {"op": "abort"}}, "command.request"),
    ({"id": "a", "monitor": "m", "command": {"op": "launch", "request": "r"}}, "command"),
    ({"monitor": "m", "command": {"op": "abort", "request": "r"}}, "id"),
    ([1, 2], "message"),
    ({"id": "a", "monitor": "m", "command": {"op": "global", "spec": {"vectors": [{"layer": -1, "vector": "v"}]}}},
     "command.spec.vectors[0].layer"),
    ({"id": "a", "monitor": b"m", "command": {"op": "abort", "request": "r"}}, "monitor"),  # strict: no coercion
    ({"id": "a", "command": {"op": "abort", "request": "r"}}, "monitor"),
    ({"id": "a", "monitor": "m", "command": {"op": b"abort", "request": "r"}}, "command.op"),
    ({"id": "a", "monitor": "m", "x y": 1, "command": {"op": "abort", "request": "r"}}, "message"),
])
def test_rejections_name_the_field(obj, field):
    with pytest.raises(SteeringValidationError) as err:
        decode_command(msgspec.msgpack.encode(obj))
    assert str(err.value).startswith(f"{field}:"), str(err.value)


def test_garbage_and_oversize_messages_are_rejected():
    for raw in (b"", b"\xc1", b"\x92\x01", b"x" * 100):
        with pytest.raises(SteeringValidationError, match="^message:"):
            decode_command(raw)
    with pytest.raises(SteeringValidationError, match="^message: .* exceeds"):
        decode_command(b"\x80" * 2000, max_bytes=1000)


def test_command_head_is_read_before_validation():
    from dynsteer.commands import command_head

    assert command_head({"monitor": "m", "command": {"op": "global", "spec": 5}}) == ("m", "global")
    assert command_head({"monitor": "m", "command": {"op": "launch"}}) == ("m", None)  # validation rejects it
    assert command_head({"monitor": "m", "command": []}) == ("m", None)


def test_shape_limits_hold_before_the_schema_and_name_the_field():
    from dynsteer.config import Limits

    entry = {"layer": 1, "vector": "v", "tier": "decode"}

    def steer(n: int, **extra) -> bytes:
        return msgspec.msgpack.encode({"id": "a", "monitor": "m", "command": {
            "op": "steer", "request": "r", "spec": {"vectors": [entry] * n}, **extra}})

    assert len(decode_command(steer(8)).command.spec.vectors) == 8
    for raw in (steer(257), msgspec.msgpack.encode({"id": "a", "monitor": "m", "command": {
            "op": "global", "spec": {"vectors": [entry] * 5500}}})):
        with pytest.raises(SteeringValidationError, match=r"^command\.spec: .*max_entries = 256"):
            decode_command(raw)
    with pytest.raises(SteeringValidationError, match=r"^command\.spec: .*max_entries = 4"):
        decode_command(steer(8), limits=Limits(max_entries=4))
    assert decode_command(steer(300), limits=None).command.spec is not None  # None: unchecked
    with pytest.raises(SteeringValidationError, match=r"^command: .*max_entries"):  # spec and policy together
        decode_command(msgspec.msgpack.encode({"id": "a", "monitor": "m", "command": {
            "op": "global", "spec": {"vectors": [entry] * 200}, "policy": {"monitors": [{}] * 100}}}))


def test_prefill_tier_is_refused():
    check_steer(SteeringSpec(vectors=[AddVector(layer=1, vector="v", tier="decode")]))
    with pytest.raises(SteeringValidationError, match=r"^command.spec.vectors\[0\].tier"):
        check_steer(SteeringSpec(vectors=[AddVector(layer=1, vector="v", tier="prefill")]))


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                  st.text(max_size=20), st.binary(max_size=20))
_json = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                st.dictionaries(st.text(max_size=10), c, max_size=4)), max_leaves=20)
_ops = st.sampled_from(["abort", "steer", "threshold", "rule", "x"])
_command = st.fixed_dictionaries({"op": _ops}, optional={
    "request": st.one_of(st.text(max_size=300), _leaf), "reason": _leaf, "monitor": _leaf, "threshold": _leaf,
    "rule": _leaf, "enabled": _leaf, "spec": st.one_of(_json, st.fixed_dictionaries(
        {"vectors": st.lists(st.dictionaries(st.sampled_from(["layer", "vector", "scale", "tier", "site", "x"]),
                                             _leaf, max_size=5), max_size=3)}))})
_envelope = st.fixed_dictionaries({}, optional={"id": st.one_of(st.text(max_size=200), _leaf),
                                                "monitor": st.one_of(st.text(max_size=20), _leaf),
                                                "v": _leaf, "command": st.one_of(_command, _json), "extra": _leaf})


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(_envelope, _json, st.binary(max_size=64)))
def test_fuzzed_commands_validate_or_name_the_field(obj):
    raw = obj if isinstance(obj, bytes) else msgspec.msgpack.encode(obj)
    try:
        env = decode_command(raw)
    except SteeringValidationError as exc:
        assert _ok(str(exc)), str(exc)
        return
    assert env.id and env.monitor  # valid: a well-formed envelope
    if isinstance(env.command, ThresholdCommand):
        assert math.isfinite(env.command.threshold)


def _policy() -> DynamicSteeringPolicy:
    mon = ProbeGate(name="m", layer=1, direction=np.eye(8, dtype=np.float32)[0], sharpness=2.0, threshold=0.5)
    return DynamicSteeringPolicy(monitors=[mon], rules=[
        Rule(monitor="m", actions=[Action(kind="add", layer=2, vector=np.ones(8, np.float32))])])


def test_patch_policy_moves_a_threshold_and_switches_a_rule():
    pol = _policy()
    moved = patch_policy(pol, ThresholdCommand(request="r", monitor="m", threshold=1.5))
    assert moved.monitors[0].threshold == 1.5 and pol.monitors[0].threshold == 0.5
    off = patch_policy(pol, RuleCommand(request="r", rule=0, enabled=False))
    assert off.rules[0].enabled is False and pol.rules[0].enabled is True
    with pytest.raises(SteeringValidationError, match="^command.monitor: unknown monitor 'x'"):
        patch_policy(pol, ThresholdCommand(request="r", monitor="x", threshold=1.0))
    with pytest.raises(SteeringValidationError, match="^command.rule: index 3"):
        patch_policy(pol, RuleCommand(request="r", rule=3, enabled=False))
    with pytest.raises(SteeringValidationError, match="^command.request: the request has no dynamic policy"):
        patch_policy(None, RuleCommand(request="r", rule=0, enabled=False))


def test_a_disabled_rule_compiles_no_action_but_keeps_its_gate():
    from dynsteer.request.compile_spec import compile_phase
    from dynsteer.spec import ModelShape
    from dynsteer.steering.dynamic.state import DynState

    shape = ModelShape(num_layers=4, hidden_size=8, max_gates=2)
    pol = _policy()
    off = patch_policy(pol, RuleCommand(request="r", rule=0, enabled=False))
    on_row = compile_phase([], "decode", shape, {}, ("p.", pol))
    off_row = compile_phase([], "decode", shape, {}, ("p.", off))
    assert on_row.sites[(2, "post_block")].dyn and (2, "post_block") not in off_row.sites
    assert off_row.sites[(1, "post_block")].monitors  # the gate is still computed
    assert on_row.digest != off_row.digest
    assert DynState.for_policy(pol).act_mask == 1 and DynState.for_policy(off).act_mask == 0


def test_command_events_fold_forward_only():
    acted = ActedState()
    acted.command(40, "mon:abc")
    assert acted.fold_at(39) == "" and acted.fold_at(40) != ""
    first = acted.fold_at(40)
    acted.command(35, "mon:def")  # an earlier position never rewrites history: it lands at 40 or later
    assert acted.fold_at(39) == "" and acted.fold_at(40) != first
    acted.report(60, 50, "sig")
    assert acted.fold_at(49) == acted.fold_at(40) and acted.fold_at(50) != acted.fold_at(49)


def test_a_threshold_command_stays_within_the_float32_gate_bounds():
    """A monitor cannot push a threshold the admitted policy could not have had (it would leave the float32 tables)."""
    for bad in (1e300, -1e13):
        obj = {"id": "a", "monitor": "m", "command": {"op": "threshold", "request": "r", "monitor": "x",
                                                      "threshold": bad}}
        with pytest.raises(SteeringValidationError) as err:
            decode_command(msgspec.msgpack.encode(obj))
        assert str(err.value).startswith("command.threshold: ") and "float32" in str(err.value), str(err.value)
    ok = {"id": "a", "monitor": "m", "command": {"op": "threshold", "request": "r", "monitor": "x", "threshold": 1e9}}
    assert decode_command(msgspec.msgpack.encode(ok)).command.threshold == 1e9
