"""JSON forms of a request's steering and presets, packed as the Python API packs them (no engine)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from dynsteer.config import DynsteerConfig, Preset
from dynsteer.engine.frontend import FrontendState
from dynsteer.request.json_form import FORMS, pack_json
from dynsteer.request.payload import encode_payload
from dynsteer.spec import AddVector, ModelShape, SteeringSpec, SteeringValidationError

H = 16
SHAPE = ModelShape(num_layers=4, hidden_size=H, sites=("post_block",))
V = [float(x) for x in np.random.default_rng(1).standard_normal(H).astype(np.float32)]
PRESET = Preset(spec={"vectors": [{"layer": 1, "vector": V, "scale": "$scale"}]},
                params={"scale": {"default": 4.0, "min": 0, "max": 16}})


def ref(scale: float = 1.0, tag: str | None = None) -> str:
    return encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=np.asarray(V, np.float32), scale=scale)]),
                          tag=tag)


def test_json_forms_pack_to_the_python_api_payload():
    obj = {"spec": {"vectors": [{"layer": 1, "vector": V, "scale": 2.5}]}, "tag": "t"}
    assert pack_json(obj, "steering") == ref(2.5, "t")
    assert pack_json(json.dumps(obj), "extra_args.dynsteer") == ref(2.5, "t")
    presets = {"joy": PRESET}
    assert pack_json({"preset": "joy"}, "steering", presets) == ref(4.0)
    assert pack_json({"preset": "joy", "params": {"scale": 6}, "tag": "t"}, "steering", presets) == ref(6, "t")


@pytest.mark.parametrize("payload, field", [
    ({"spec": {"vectors": [{"layer": "x", "vector": V}]}}, "steering.spec.vectors[0].layer"),
    ("not json", "steering: not a packed payload"),
    ("{oops", "steering: malformed JSON"),
    (3, "steering: expected an object"),
    ({"preset": "nobody"}, "steering.preset"),
    ({"preset": "joy", "params": {"scale": 16.5}}, "steering.params.scale"),
    ({"preset": "joy", "params": {"scale": True}}, "steering.params.scale"),
    ({"preset": "joy", "params": {"other": 1}}, "steering.params.other"),
    ({"preset": "joy", "spec": {}}, "steering.spec"),
    ({"params": {"scale": 1}}, "steering.params"),
])
def test_bad_forms_name_the_field(payload, field):
    with pytest.raises(SteeringValidationError) as err:
        pack_json(payload, "steering", {"joy": PRESET})
    assert str(err.value).startswith(field), err.value
    if "not a packed" in field or "malformed" in field or "expected an object" in field:
        assert FORMS in str(err.value)


@pytest.mark.parametrize("preset, message", [
    ({"spec": {"vectors": [{"layer": 1, "vector": "v", "scale": "$s"}]}}, "'$s' is not a declared parameter"),
    ({"spec": {}, "params": {"s": {"default": 1}}}, "no '$s' placeholder"),
    ({"spec": {"x": "$s"}, "params": {"s": {"default": 3, "max": 2}}}, "default 3 is outside"),
    ({"spec": {"x": "$s"}, "params": {"s": {"default": "3"}}}, "default"),
])
def test_bad_presets_are_refused(preset, message):
    with pytest.raises(ValidationError) as err:
        DynsteerConfig(presets={"p": preset})
    assert message in str(err.value)


def test_frontend_memoises_json_forms_per_presets_version():
    state = FrontendState(SHAPE)
    text = json.dumps({"preset": "joy", "params": {"scale": 2}})
    with pytest.raises(SteeringValidationError, match="steering.preset"):
        state.pack(text, "steering")
    state.set_preset("joy", PRESET)
    assert state.pack(text, "steering") == ref(2) and len(state._packed) == 1
    assert state.pack(text, "steering") == ref(2) and len(state._packed) == 1  # a hit
    assert state.pack(ref(3), "steering") == ref(3)  # the packed form as it is, not memoised here
    assert state.pack({"preset": "joy", "params": {"scale": 2}}, "steering") == ref(2) and len(state._packed) == 2
    changed = Preset(spec={"vectors": [{"layer": 2, "vector": V, "scale": "$scale"}]},
                     params={"scale": {"default": 1.0}})
    state.set_preset("joy", changed)  # a new version: the old entries are never hit again
    assert state.pack(text, "steering") == encode_payload(
        SteeringSpec(vectors=[AddVector(layer=2, vector=np.asarray(V, np.float32), scale=2)]))
    with pytest.raises(SteeringValidationError, match=r"presets.bad.spec.vectors\[0\].layer"):
        state.set_preset("bad", Preset(spec={"vectors": [{"layer": 7, "vector": V}]}))
    assert "bad" not in state.presets
    state.set_preset("joy", None)
    assert state.presets == {}
