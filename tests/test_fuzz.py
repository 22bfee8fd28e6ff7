"""Property-based fuzzing of request payloads and policies (hypothesis).

* Admission (no engine, 10,000 cases): every payload either is admitted or is rejected with a
  :class:`SteeringValidationError` whose message starts with the field it names; nothing else is ever raised; the
  workers' own admission agrees with the frontend's (what the frontend admits, a worker runs; what it rejects, a
  worker stops with the same field named).
* A real engine (CPU, tiny Llama): batches of fuzzed requests beside a good one: no crash or hang, every rejection
  or stop names a field, the good request's tokens are exact.
"""

from __future__ import annotations

import base64
import copy
import math
import re

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynsteer import (Action, AddVector, Ablation, CaptureSpec, DynamicSteeringPolicy, ProbeGate, ProjectionClamp, Rule,
                      SteeringSpec, SteeringValidationError, SyncControllerSpec)
import torch

from dynsteer.capture.consumers import MemoryConsumer
from dynsteer.capture.store import CaptureCollector
from dynsteer.config import Limits
from dynsteer.controllers.registry import ControllerRegistry
from dynsteer.engine.frontend import FrontendState
from dynsteer.spec import ModelShape
from dynsteer.steering.runtime import SteeringRuntime
from dynsteer.steering.tables import SteeringTables

H, LAYERS = 8, 4
FIELD = re.compile(r"^extra_args\.dynsteer(\.[A-Za-z0-9_\[\]\.?-]+)?: \S")
LIMITS = Limits(max_entries=48, max_depth=12, max_payload_bytes=32 << 10, max_capture_positions=512)
SHAPE = ModelShape(num_layers=LAYERS, hidden_size=H, max_gates=2, max_clamps=2)



def _unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(H)
    return (v / np.linalg.norm(v)).astype(np.float32)


def _probe():
    from dynsteer.probefile.fileformat import Probe, ProbeMeta

    return Probe(weight=_unit(9), meta=ProbeMeta(model_id="fuzz", hidden_size=H, layer=1, bias=0.1))


def _templates() -> list[dict]:
    """Valid payload bodies (JSON form) covering every schema the fuzzer mutates."""
    u = _unit
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector=u(1), scale=2.0, tier="decode"),
                                 AddVector(layer=2, vector="v", site="post_attn")],
                        clamps=[ProjectionClamp(layer=2, direction=u(2), lo=-1.0, hi=1.0)],
                        ablations=[Ablation(layer=3, direction="v", strength=0.5)])
    pol = DynamicSteeringPolicy(
        monitors=[ProbeGate(name="m", layer=1, direction=u(3), sharpness=2.0, threshold=0.1),
                  ProbeGate(name="p", layer=1, probe="p", target_class=0)],
        rules=[Rule(monitor="m", actions=[Action(kind="add", layer=2, vector=u(4), scale=1.5),
                                          Action(kind="clamp", layer=3, vector="v", hi=0.5)], scope="next_step"),
               Rule(monitor="p", actions=[Action(kind="ablate", layer=1, site="post_block", vector=u(5))],
                    gate_floor=0.2)],
        controller=SyncControllerSpec(kind="budget", monitor="m", max_steered_tokens=4,
                                      inner=SyncControllerSpec(kind="ema_latch", alpha=0.5, on=1.0, off=0.0,
                                                               scale=2.0)))
    custom = DynamicSteeringPolicy(monitors=pol.monitors[:1], rules=pol.rules[:1],
                                   controller=SyncControllerSpec(kind="custom", name="c", options={"gain": 0.25}))
    cap = CaptureSpec(layers=(1,), positions=(0, 1, 2), dtype="float16")
    return [{"spec": spec.model_dump(mode="json")},
            {"spec": spec.model_dump(mode="json"), "policy": pol.model_dump(mode="json", exclude_none=True),
             "tag": "t-1", "trace": True},
            {"policy": custom.model_dump(mode="json", exclude_none=True), "capture": cap.model_dump(mode="json")},
            {"spec": {}, "capture": {"layers": [1], "positions": "all_generated"}}]


TEMPLATES = _templates()
KEYS = ["spec", "policy", "capture", "tag", "trace", "vectors", "clamps", "ablations", "layer", "site", "vector",
        "scale", "tier", "direction", "lo", "hi", "strength", "monitors", "rules", "controller", "kind", "name",
        "options", "actions", "monitor", "scope", "gate_floor", "probe", "probe_file", "sharpness", "threshold",
        "layers", "sites", "positions", "dtype", "consumers", "version", "inner", "max_steered_tokens", "factory",
        "on", "off", "alpha", "target", "kp", "ki", "kd", "min_scale", "max_scale", "target_class", "calibrated",
        "b64"]
NASTY = [math.nan, math.inf, -math.inf, 1e38, -1e38, 1e300, 5e-324, 0, -1, 2 ** 31, 2 ** 63 - 1, "1", "", True, False,
         None, [], {}, "../x", "/etc/passwd", "a" * 300, "subprocess:getoutput", "os:system", {"b64": "AAAA"},
         {"b64": "!!"}, {"b64": base64.b64encode(np.full(H, np.inf, np.float32).tobytes()).decode()},
         [1.0] * (H + 1), [0.0] * H, "v", "p", "c", "post_attn", "decode", "custom", "latch", "pid", "budget",
         "all_prompt", list(range(600))]
scalars = st.one_of(st.sampled_from(NASTY), st.floats(allow_nan=True, allow_infinity=True),
                    st.integers(-2 ** 64, 2 ** 64), st.text(max_size=12), st.booleans(), st.none())
trees = st.recursive(scalars, lambda ch: st.one_of(st.lists(ch, max_size=4),
                                                   st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), ch,
                                                                   max_size=4)), max_leaves=20)


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


@st.composite
def bodies(draw):
    if draw(st.integers(0, 9)) == 0:
        return copy.deepcopy(draw(trees))  # anything at all (copied: NASTY's lists must not be mutated)
    body = copy.deepcopy(draw(st.sampled_from(TEMPLATES)))
    for _ in range(draw(st.integers(0, 3))):
        paths = [p for p in _paths(body) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = body
        for k in path[:-1]:
            parent = parent[k]
        action = draw(st.integers(0, 3))
        if action == 0 and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == 1 and isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYS))] = copy.deepcopy(draw(trees))
        else:
            parent[path[-1]] = copy.deepcopy(draw(trees))
    return body


def _pack(body) -> str | None:
    try:
        return "ds1:" + base64.b64encode(msgspec.msgpack.encode(body)).decode()
    except (TypeError, OverflowError, ValueError):
        return None  # not representable in msgpack (an int beyond 64 bits): no client can send it


def _frontend() -> FrontendState:
    return FrontendState(SHAPE, named={"v": _unit(0)}, capture_places={(1, "post_block")}, limits=LIMITS,
                         probes={"p": _probe()}, controllers={"c"}, capacity=64)


def _runtime() -> SteeringRuntime:
    sites = [(l, s) for l in range(LAYERS) for s in ("pre_attn", "post_attn", "post_block")]
    tables = SteeringTables(sites, H, num_rows=64, max_clamps=2, max_tokens=32, max_gates=2)
    rt = SteeringRuntime(SHAPE, tables, LIMITS, {"p": _probe()},
                         ControllerRegistry({"c": "dynsteer.testing.controllers:Halver"}))
    rt.register_vector("v", _unit(0))
    place = (1, "post_block")
    rt.attach_capture(CaptureCollector({place: torch.zeros(32, H)}, engine_places={place}),
                      {"memory": MemoryConsumer()})
    return rt


FRONT, RT = _frontend(), _runtime()
COUNT = {"admitted": 0, "rejected": 0}


@settings(max_examples=10_000, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=bodies(), as_object=st.booleans())
def test_admission_names_the_field_or_admits_and_workers_agree(body, as_object):
    payload = body if as_object and isinstance(body, dict) else _pack(body)
    if payload is None:
        return
    try:
        FRONT.admit(payload)
        ok = True
    except SteeringValidationError as exc:
        assert FIELD.match(str(exc)), str(exc)
        ok = False
    COUNT["admitted" if ok else "rejected"] += 1
    entry = RT.admit("req", payload, prompt_len=5)
    stops = RT.take_stops()
    RT.release(["req"])
    if ok:
        # a custom controller's options are only checked when the worker builds it (operator code)
        assert entry.error is None and not stops or ".controller.options: controller 'c' could not be built" in \
            stops.get("req", ""), stops
    else:
        assert set(stops) == {"req"} and re.match(r"^dynsteer: extra_args\.dynsteer[\.:\[]", stops["req"]), stops
    assert RT.pool.in_use == 0


def test_the_fuzzer_reached_both_outcomes():
    """Guards the fuzzer itself: it must have exercised admissions and rejections in volume."""
    if COUNT["admitted"] + COUNT["rejected"] < 9000:
        pytest.skip("run together with the admission fuzz test")
    assert COUNT["admitted"] > 500 and COUNT["rejected"] > 3000, COUNT


# ---- a real engine -----------------------------------------------------------------------------------------------------
ENGINE_H = 128
ENGINE_COUNT = {"good": 0, "ran": 0, "rejected": 0}


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    import dynsteer
    from dynsteer import DynsteerConfig
    from tests.conftest import make_llm, token_ids

    cfg = DynsteerConfig(max_gates=2, capture_sites=("post_block",), capture_layers=(1,),
                         controllers={"c": "dynsteer.testing.controllers:Halver"}, limits=LIMITS)
    with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
        st_ = dynsteer.attach(llm)
        st_.register_vector("v", _wide(0))
        good = SteeringSpec(vectors=[AddVector(layer=1, vector=_wide(1), scale=3.0)])
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        ref = token_ids(st_.generate(["a good request"], params, steering=good))[0]
        yield llm, good, ref, params


def _wide(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(ENGINE_H) * 4).astype(np.float32)


def _widen(body):
    """Resize the fuzzer's 8-wide inline vectors to the engine's hidden size (most then pass the shape check)."""
    if isinstance(body, dict):
        if set(body) == {"b64"} and isinstance(body["b64"], str):
            try:
                raw = np.frombuffer(base64.b64decode(body["b64"], validate=True), "<f4")
            except ValueError:
                return body
            if raw.size == H:
                return {"b64": base64.b64encode(np.resize(raw, ENGINE_H).astype("<f4").tobytes()).decode()}
            return body
        return {k: _widen(v) for k, v in body.items()}
    if isinstance(body, list):
        return [_widen(v) for v in body]
    return body


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(batch=st.lists(bodies(), min_size=3, max_size=3))
def test_engine_survives_fuzzed_batches_and_good_requests_stay_exact(engine, batch):
    import time as _time

    from dynsteer.request.payload import encode_payload

    llm, good, ref, params = engine
    eng = llm.llm_engine
    ids = {}
    for i, body in enumerate([None, *batch]):
        p = params.clone()
        payload = encode_payload(good) if body is None else _pack(_widen(body))
        if payload is None:
            continue
        p.extra_args = {"dynsteer": payload}
        rid = f"f{i}-{_time.monotonic_ns()}"
        try:
            eng.add_request(rid, "a good request", p)
            ids[rid] = i
            ENGINE_COUNT["ran" if i else "good"] += 1
        except ValueError as exc:
            assert FIELD.match(str(exc)), str(exc)
            ENGINE_COUNT["rejected"] += 1
    outs = {}
    deadline = _time.monotonic() + 120
    while eng.has_unfinished_requests():
        assert _time.monotonic() < deadline, "engine hung"
        for out in eng.step():
            if out.finished:
                outs[ids[out.request_id]] = out.outputs[0]
    assert list(outs[0].token_ids) == ref
    for i, out in outs.items():
        if out.finish_reason == "abort":
            assert re.match(r"^dynsteer: (extra_args\.dynsteer|policy\.controller)", str(out.stop_reason)), out


def test_the_engine_fuzzer_ran_requests_through_the_engine():
    if ENGINE_COUNT["good"] < 100:
        pytest.skip("run together with the engine fuzz test")
    assert ENGINE_COUNT["ran"] > 30 and ENGINE_COUNT["rejected"] > 100, ENGINE_COUNT
