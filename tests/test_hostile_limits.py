"""Limits a hostile client leans on, checked without an engine (architecture §10): payload entries counted exactly, gate
parameters that stay finite in float32 tables, capture consumers and repeats, the named-vector count.

The same cases through a real engine are in ``tests/test_security.py`` (in process) and ``tests/test_serve.py``
(HTTP).
"""

from __future__ import annotations

import base64
import time

import msgspec
import numpy as np
import pytest

from dynsteer import (Action, AddVector, CaptureSpec, DynamicSteeringPolicy, ProbeGate, Rule, SteeringSpec,
                      SteeringValidationError)
from dynsteer.config import Limits
from dynsteer.engine.frontend import FrontendState
from dynsteer.config import check_shape
from dynsteer.request.payload import encode_payload
from dynsteer.spec import ModelShape

H, LAYERS = 8, 4
SHAPE = ModelShape(num_layers=LAYERS, hidden_size=H, max_gates=2, max_clamps=2)


def pack_raw(body: dict) -> str:
    return "ds1:" + base64.b64encode(msgspec.msgpack.encode(body)).decode()


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(H)
    return (v / np.linalg.norm(v)).astype(np.float32)


def probe(weight: np.ndarray, bias: float = 0.0, layer: int = 1):
    from dynsteer.probefile.fileformat import Probe, ProbeMeta

    return Probe(weight=weight.astype(np.float32), meta=ProbeMeta(model_id="t", hidden_size=H, layer=layer,
                                                                 bias=bias))


def frontend(**kw) -> FrontendState:
    return FrontendState(SHAPE, **{"named": {"v": unit(0)}, "capture_places": {(1, "post_block")}, **kw})


def rejection(front: FrontendState, payload) -> str:
    with pytest.raises(SteeringValidationError) as err:
        front.admit(payload)
    return str(err.value)


# ---- max_entries: exactly the limit passes, one more is refused, whichever section holds them ---------------------
N = 24
LIMITS = Limits(max_entries=N)
ENTRY = {"layer": 1, "vector": "v"}
SECTIONS = {
    "spec.vectors": lambda n: {"spec": {"vectors": [ENTRY] * n}},
    "spec.clamps": lambda n: {"spec": {"clamps": [{"layer": 1, "direction": "v", "hi": 0.0}] * n}},
    "spec.ablations": lambda n: {"spec": {"ablations": [{"layer": 1, "direction": "v"}] * n}},
    "policy.monitors": lambda n: {"policy": {"monitors": [{"name": f"m{i}", "layer": 1, "probe": "p"}
                                                          for i in range(n)]}},
    "policy.rules": lambda n: {"policy": {"monitors": [], "rules": [{"monitor": "m", "abort": "x"}] * n}},
    # one rule and its actions: the rule is an entry too
    "policy.rules[0].actions": lambda n: {"policy": {"rules": [{"monitor": "m", "actions": [
        {"kind": "add", "layer": 1, "vector": {"b64": "AAAA"}}] * (n - 1)}]}},
    "capture.layers": lambda n: {"capture": {"layers": list(range(n))}},
    "mixed": lambda n: {"spec": {"vectors": [ENTRY] * (n // 2)}, "capture": {"layers": list(range(n - n // 2))}},
}


@pytest.mark.parametrize("section", list(SECTIONS))
def test_max_entries_is_exact_for_every_section(section):
    make = SECTIONS[section]
    check_shape(make(N), "extra_args.dynsteer", LIMITS)  # the wrappers around the entries are not entries
    with pytest.raises(SteeringValidationError) as err:
        check_shape(make(N + 1), "extra_args.dynsteer", LIMITS)
    assert str(err.value).startswith(f"extra_args.dynsteer: payload holds more than the engine's limit "
                                     f"max_entries = {N} entries"), err.value


def test_exactly_max_entries_are_admitted_end_to_end():
    front = frontend(limits=LIMITS)
    spec = SteeringSpec(vectors=[AddVector(layer=i % LAYERS, vector="v", scale=0.5) for i in range(N)])
    front.admit(encode_payload(spec))  # the JSON-object form counts the same
    front.admit({"spec": spec.model_dump(mode="json")})
    over = SteeringSpec(vectors=[*spec.vectors, AddVector(layer=0, vector="v")])
    assert "max_entries = 24" in rejection(front, encode_payload(over))


def test_objects_besides_entries_stay_bounded():
    """Objects outside the entry lists (here a custom controller's options) are bounded too: the walk before schema
    validation never meets an unbounded number of them."""
    body = {"policy": {"controller": {"kind": "custom", "name": "c", "options": {f"k{i}": {} for i in range(200)}}}}
    with pytest.raises(SteeringValidationError) as err:
        check_shape(body, "extra_args.dynsteer", LIMITS)
    assert "objects besides its entries" in str(err.value)


# ---- gate parameters land in float32 tables ------------------------------------------------------------------------
def monitor_payload(**monitor) -> str:
    mon = {"name": "m", "layer": 1, "direction": {"b64": base64.b64encode(unit(3).tobytes()).decode()},
           "sharpness": 2.0, "threshold": 0.0, **monitor}
    pol = {"monitors": [mon], "rules": [{"monitor": "m", "actions": [
        {"kind": "add", "layer": 2, "vector": {"b64": base64.b64encode(unit(4).tobytes()).decode()}}]}]}
    return pack_raw({"policy": pol})


@pytest.mark.parametrize("field,value", [("sharpness", 1e300), ("sharpness", 3.5e38), ("sharpness", 1e9),
                                         ("sharpness", 1e-300), ("threshold", 1e300), ("threshold", -1e39),
                                         ("threshold", 1e13)])
def test_gate_parameters_that_leave_float32_are_rejected_naming_the_field(field, value):
    message = rejection(frontend(), monitor_payload(**{field: value}))
    assert message.startswith(f"extra_args.dynsteer.policy.monitors[0].{field}: "), message


def test_gate_parameters_within_the_bounds_give_finite_float32_tables():
    from dynsteer.policy import MAX_ABS_THRESHOLD, MAX_SHARPNESS, MIN_SHARPNESS
    from dynsteer.request.compile_spec import compile_phase

    for sharpness in (MIN_SHARPNESS, 1e6, MAX_SHARPNESS):
        for threshold in (-MAX_ABS_THRESHOLD, -1e9, 0.0, 1e9, MAX_ABS_THRESHOLD):
            payload = monitor_payload(sharpness=sharpness, threshold=threshold)
            frontend().admit(payload)
            from dynsteer.request.payload import decode_payload

            pol = decode_payload(payload).policy
            row = compile_phase([], "decode", SHAPE, {}, ("policy.", pol))
            for prog in row.sites.values():
                for mon in prog.monitors.values():
                    values = np.array([mon.sharpness, mon.threshold], np.float32)
                    assert np.all(np.isfinite(values)) and values[0] > 0
                    # the kernel's logit for a large real score stays finite too
                    assert np.isfinite(values[0] * (np.float32(1e5) - values[1]))


def test_probe_derived_gate_parameters_are_bounded_and_real_probes_pass():
    """A registered probe's sharpness is its weight norm, its threshold −bias/‖w‖: probes with weight norms in the
    hundreds (and their calibrated forms) stay valid; a degenerate one is refused naming the monitor's probe."""
    real = probe(unit(5) * 300.0, bias=-40.0)
    huge = probe(unit(5) * 1e10)
    tiny = probe(unit(5) * 1e-9, bias=1.0)  # a slope of 1e-9, under MIN_SHARPNESS (its threshold −b/‖w‖ is −1e9)
    front = frontend(probes={"real": real, "huge": huge, "tiny": tiny})

    def with_probe(name: str) -> str:
        pol = DynamicSteeringPolicy(monitors=[ProbeGate(name="m", layer=1, probe=name)],
                                    rules=[Rule(monitor="m", actions=[Action(kind="add", layer=2, vector=unit(4))])])
        return encode_payload(policy=pol)

    front.admit(with_probe("real"))
    assert real.gate_params().sharpness == pytest.approx(300.0, rel=1e-6)
    for name in ("huge", "tiny"):
        message = rejection(front, with_probe(name))
        assert message.startswith(f"extra_args.dynsteer.policy.monitors[0].probe: '{name}' gives an out-of-range sharpness"), message


def test_probe_file_gate_parameters_are_checked_in_the_callers_process(tmp_path):
    from dynsteer.probefile.fileformat import save_probe

    path = save_probe(tmp_path / "huge.safetensors", unit(5) * 1e10, bias=0.0, model_id="t", layer=1)
    pol = DynamicSteeringPolicy(monitors=[ProbeGate(name="m", layer=1, probe_file=str(path))],
                                rules=[Rule(monitor="m", actions=[Action(kind="add", layer=2, vector=unit(4))])])
    with pytest.raises(SteeringValidationError) as err:
        pol.resolved()
    assert str(err.value).startswith("monitors[0].probe_file: "), err.value
    with pytest.raises(SteeringValidationError) as err:
        pol.check(SHAPE)
    assert str(err.value).startswith("monitors[0].probe_file: "), err.value


# ---- capture: consumers the engine has, each thing once ------------------------------------------------------------
def test_capture_naming_an_unknown_consumer_is_rejected_at_admission():
    front = frontend(consumers=frozenset({"memory", "archive"}))
    ok = CaptureSpec(layers=(1,), consumers=("memory", "archive"))
    front.admit(encode_payload(capture=ok))
    for consumers, index in ((("nope",), 0), (("memory", "../etc"), 1)):
        message = rejection(front, encode_payload(capture=CaptureSpec(layers=(1,), consumers=consumers)))
        assert message.startswith(f"extra_args.dynsteer.capture.consumers[{index}]: unknown consumer"), message
        assert "configured: archive, memory" in message


def test_capture_repeats_are_refused_before_any_product_is_formed():
    """Places are layers × sites: repeated layers and sites would multiply the work (quadratic in the payload)."""
    front = frontend(limits=Limits())
    body = {"capture": {"layers": [1] * 200, "sites": ["post_block"] * 20_000}}
    t0 = time.perf_counter()
    message = rejection(front, pack_raw(body))
    assert time.perf_counter() - t0 < 2.0
    assert message.startswith("extra_args.dynsteer.capture.layers: 1 is listed twice (items 0 and 1)"), message
    message = rejection(front, pack_raw({"capture": {"layers": [1], "sites": ["post_block", "post_block"]}}))
    assert message.startswith("extra_args.dynsteer.capture.sites: 'post_block' is listed twice"), message
    message = rejection(front, pack_raw({"capture": {"layers": [1], "consumers": ["memory"] * 3}}))
    assert message.startswith("extra_args.dynsteer.capture.consumers: 'memory' is listed twice"), message


# ---- named vectors: a bounded count, refused before anything changes -----------------------------------------------
def test_frontend_named_vector_limit():
    front = FrontendState(SHAPE, limits=Limits(max_named_vectors=2))
    front.register("a", unit(1))
    front.register("b", unit(2))
    version = front.version
    front.register("a", unit(3))  # replacing is fine
    with pytest.raises(SteeringValidationError) as err:
        front.check_register("c")
    assert str(err.value).startswith("name: cannot register 'c'") and "max_named_vectors = 2" in str(err.value)
    with pytest.raises(SteeringValidationError):
        front.register("c", unit(4))
    assert sorted(front.named) == ["a", "b"] and front.version == version + 1


def test_worker_named_vector_limit():
    from dynsteer.steering.runtime import SteeringRuntime
    from dynsteer.steering.tables import SteeringTables

    sites = [(l, s) for l in range(LAYERS) for s in ("pre_attn", "post_attn", "post_block")]
    rt = SteeringRuntime(SHAPE, SteeringTables(sites, H, num_rows=8, max_clamps=2, max_tokens=16, max_gates=2),
                         Limits(max_named_vectors=2))
    rt.register_vector("a", unit(1))
    rt.register_vector("b", unit(2))
    rt.register_vector("b", unit(5))
    with pytest.raises(SteeringValidationError) as err:
        rt.register_vector("c", unit(3))
    assert str(err.value).startswith("name: cannot register 'c'")
    assert sorted(rt.named) == ["a", "b"] and np.array_equal(rt.named["b"], unit(5))


def test_a_registered_probe_out_of_float32_range_fails_start_up_naming_its_entry(tmp_path):
    """Registered probes are checked where the engine loads them, not when a request first names one."""
    from dynsteer.config import DynsteerConfig
    from dynsteer.engine.build import load_probes
    from dynsteer.probefile.fileformat import save_probe

    good = save_probe(tmp_path / "good.safetensors", unit(5) * 300.0, bias=-4.0, model_id="t", layer=1)
    huge = save_probe(tmp_path / "huge.safetensors", unit(5) * 1e10, bias=0.0, model_id="t", layer=1)
    assert set(load_probes(DynsteerConfig(probes={"good": str(good)}))) == {"good"}
    with pytest.raises(ValueError) as err:
        load_probes(DynsteerConfig(probes={"good": str(good), "huge": str(huge)}))
    assert str(err.value).startswith("dynsteer.probes['huge']: probe file ") and "gate sharpness" in str(err.value)


def test_the_worker_checks_capture_consumers_on_every_rank():
    """What bypasses the frontend is stopped in the worker, naming the field, whichever rank builds consumers."""
    import torch

    from dynsteer.capture.store import CaptureCollector
    from dynsteer.steering.runtime import SteeringRuntime
    from dynsteer.steering.tables import SteeringTables

    sites = [(l, s) for l in range(LAYERS) for s in ("pre_attn", "post_attn", "post_block")]
    rt = SteeringRuntime(SHAPE, SteeringTables(sites, H, num_rows=8, max_clamps=2, max_tokens=16))
    place = (1, "post_block")
    rt.attach_capture(CaptureCollector({place: torch.zeros(16, H)}, emit=False, engine_places={place}), {})
    rt.consumer_names = frozenset({"memory"})  # what the engine adapter sets from DynsteerConfig.capture_consumers
    rt.admit("ok", encode_payload(capture=CaptureSpec(layers=(1,))), prompt_len=4)
    rt.admit("bad", encode_payload(capture=CaptureSpec(layers=(1,), consumers=("nope",))), prompt_len=4)
    stops = rt.take_stops()
    assert set(stops) == {"bad"}, stops
    assert stops["bad"].startswith("dynsteer: extra_args.dynsteer.capture.consumers[0]: unknown consumer 'nope'")
