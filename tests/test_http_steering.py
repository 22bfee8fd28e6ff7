"""Steering from any HTTP client on ``dynsteer serve``: JSON forms, presets, the global spec, validate and encode.

The client side is plain ``urllib`` and JSON; dynsteer is imported only to build each test's packed reference
(:func:`dynsteer.request.payload.encode_payload`), and every JSON form must give greedy tokens identical to it.
One server per module (tiny Llama on CPU, ``--api-key`` set, a preset in the engine's config).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from dynsteer.policy import Action, DynamicSteeringPolicy, ProbeGate, Rule
from dynsteer.request.payload import encode_payload
from dynsteer.spec import AddVector, SteeringSpec
from tests.conftest import dynsteer_served, http_json

KEY = "test-key-json"
HIDDEN = 128
PROMPTS = ["the quick brown fox", "once upon a time"]
MAX_TOKENS = 8


def vec(seed: int, scale: float = 8.0) -> list[float]:
    """A vector as a client writes it: a JSON list (float32 values, so the packed reference holds the same)."""
    return [float(x) for x in (np.random.default_rng(seed).standard_normal(HIDDEN) * scale).astype(np.float32)]


def arr(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


JOY = vec(11, 1.0)
PRESET = {"spec": {"vectors": [{"layer": 1, "vector": JOY, "scale": "$scale"}]},
          "params": {"scale": {"default": 4.0, "min": 0, "max": 16}}}


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_json") / "server.log"
    cfg = {"max_gates": 2, "max_rows": 16, "presets": {"joy": PRESET}}
    with dynsteer_served(tiny_llama_path, log, KEY, cfg) as url:
        yield url, str(tiny_llama_path)


def call(server, method: str, path: str, body=None) -> tuple[int, dict]:
    url, _ = server
    return http_json(f"{url}{path}", method, body, KEY, timeout=300)


def complete(server, prompt: str = PROMPTS[0], chat: bool = False, **extra) -> str:
    """Greedy tokens of one request; ``extra``: more body fields (``steering``, ``vllm_xargs``)."""
    _, model = server
    if chat:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
                "temperature": 0, **extra}
        status, reply = call(server, "POST", "/v1/chat/completions", body)
        assert status == 200, reply
        return reply["choices"][0]["message"]["content"]
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    status, reply = call(server, "POST", "/v1/completions", body)
    assert status == 200, reply
    return reply["choices"][0]["text"]


def packed(server, payload: str, prompt: str = PROMPTS[0], chat: bool = False) -> str:
    """Greedy tokens of a request sending ``payload`` (the packed reference) in ``vllm_xargs``."""
    return complete(server, prompt, chat, vllm_xargs={"dynsteer": payload})


def refused(server, body_extra: dict, chat: bool = False) -> str:
    """The message of a request that must be refused with a 400."""
    _, model = server
    body = ({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} if chat
            else {"model": model, "prompt": PROMPTS[0], "max_tokens": 2})
    status, reply = call(server, "POST", "/v1/chat/completions" if chat else "/v1/completions", {**body, **body_extra})
    assert status == 400, reply
    return message(reply)


def message(reply: dict) -> str:
    err = reply.get("error", reply)
    return err.get("message", "") if isinstance(err, dict) else str(err) or json.dumps(reply)


@pytest.fixture(scope="module")
def baseline(server):
    return {p: complete(server, p) for p in PROMPTS}


def test_json_string_and_top_level_field_equal_the_packed_form(server, baseline):
    v = vec(3)
    steering = {"spec": {"vectors": [{"layer": 1, "vector": v, "scale": 1.5}]}}
    reference = encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=arr(v), scale=1.5)]))
    for prompt in PROMPTS:
        want = packed(server, reference, prompt)
        assert want != baseline[prompt]
        assert complete(server, prompt, vllm_xargs={"dynsteer": json.dumps(steering)}) == want
        assert complete(server, prompt, steering=steering) == want
    assert [complete(server, p) for p in PROMPTS] == list(baseline.values())  # unsteered stays unsteered
    # chat completions take both forms too
    want = packed(server, reference, "hi", chat=True)
    assert complete(server, "hi", chat=True, steering=steering) == want
    assert complete(server, "hi", chat=True, vllm_xargs={"dynsteer": json.dumps(steering)}) == want
    assert want != complete(server, "hi", chat=True)


def test_vectors_by_name_and_b64_in_json(server, baseline):
    v = vec(5)
    status, _ = call(server, "POST", "/v1/steering/vectors", {"name": "calm", "vector": v})
    assert status == 200
    try:
        reference = encode_payload(SteeringSpec(vectors=[AddVector(layer=2, vector=arr(v))]), tag="t-1")
        want = packed(server, reference)
        assert want != baseline[PROMPTS[0]]
        by_name = {"spec": {"vectors": [{"layer": 2, "vector": "calm"}]}, "tag": "t-1"}
        assert complete(server, steering=by_name) == want
        import base64

        b64 = {"b64": base64.b64encode(arr(v).astype("<f4").tobytes()).decode()}
        assert complete(server, steering={"spec": {"vectors": [{"layer": 2, "vector": b64}]}}) == want
    finally:
        assert call(server, "DELETE", "/v1/steering/vectors/calm")[0] == 200


def test_preset_from_config_with_a_scale_override(server, baseline):
    status, listed = call(server, "GET", "/v1/steering/presets")
    assert status == 200 and listed["presets"]["joy"]["params"]["scale"]["max"] == 16
    for scale, steering in ((6, {"preset": "joy", "params": {"scale": 6}}), (4.0, {"preset": "joy"})):
        spec = SteeringSpec(vectors=[AddVector(layer=1, vector=arr(JOY), scale=scale)])
        want = packed(server, encode_payload(spec))
        assert want != baseline[PROMPTS[0]]
        assert complete(server, steering=steering) == want
        assert complete(server, vllm_xargs={"dynsteer": json.dumps(steering)}) == want
    assert complete(server, steering={"preset": "joy", "params": {"scale": 6}}) != complete(
        server, steering={"preset": "joy", "params": {"scale": 16}})


def test_presets_put_use_delete_over_http(server, baseline):
    preset = {"spec": {"vectors": [{"layer": 2, "vector": vec(8, 1.0), "scale": "$s"}]},
              "params": {"s": {"default": 2, "min": 1, "max": 8}}}
    status, reply = call(server, "PUT", "/v1/steering/presets/bold", preset)
    assert status == 200, reply
    try:
        bold = arr(preset["spec"]["vectors"][0]["vector"])
        want = packed(server, encode_payload(SteeringSpec(vectors=[AddVector(layer=2, vector=bold, scale=8)])))
        assert want != baseline[PROMPTS[0]]
        assert complete(server, steering={"preset": "bold", "params": {"s": 8}}) == want
        assert sorted(call(server, "GET", "/v1/steering/presets")[1]["presets"]) == ["bold", "joy"]
    finally:
        assert call(server, "DELETE", "/v1/steering/presets/bold") == (200, {"deleted": "bold"})
    assert "steering.preset" in refused(server, {"steering": {"preset": "bold"}})
    assert call(server, "DELETE", "/v1/steering/presets/bold")[0] == 404


def test_per_request_dynamic_policy_as_json(server, baseline):
    direction, action = [1.0] + [0.0] * (HIDDEN - 1), vec(1)
    policy = {"monitors": [{"name": "m", "layer": 1, "direction": direction, "sharpness": 4.0, "threshold": -1e3}],
              "rules": [{"monitor": "m", "actions": [{"kind": "add", "layer": 2, "vector": action}]}]}
    reference = encode_payload(policy=DynamicSteeringPolicy(
        monitors=[ProbeGate(name="m", layer=1, direction=arr(direction), sharpness=4.0, threshold=-1e3)],
        rules=[Rule(monitor="m", actions=[Action(kind="add", layer=2, vector=arr(action))])]))
    want = packed(server, reference)
    assert want != baseline[PROMPTS[0]]
    assert complete(server, steering={"policy": policy}) == want
    assert complete(server, vllm_xargs={"dynsteer": json.dumps({"policy": policy})}) == want


def test_global_spec_route(server, baseline):
    v = vec(4)
    spec = {"vectors": [{"layer": 1, "vector": v, "scale": 2.0}]}
    reference = encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=arr(v), scale=2.0)]))
    want = {p: packed(server, reference, p) for p in PROMPTS}
    assert call(server, "GET", "/v1/steering/spec") == (200, {"spec": None})
    status, reply = call(server, "PUT", "/v1/steering/spec", {"spec": spec})
    assert status == 200 and reply["spec"]["vectors"][0]["layer"] == 1, reply
    try:
        assert call(server, "GET", "/v1/steering/spec")[1]["spec"]["vectors"][0]["scale"] == 2.0
        assert {p: complete(server, p) for p in PROMPTS} == want  # every request is steered now
        assert want != baseline
    finally:
        assert call(server, "DELETE", "/v1/steering/spec") == (200, {"spec": None})
    assert {p: complete(server, p) for p in PROMPTS} == baseline
    status, reply = call(server, "PUT", "/v1/steering/spec", {"spec": {"vectors": [{"layer": 9, "vector": v}]}})
    assert status == 400 and "body.spec" in message(reply) and "9" in message(reply), reply
    status, reply = call(server, "PUT", "/v1/steering/spec", {"spec": {"vectors": [{"layer": 1, "vector": [1.0]}]}})
    assert status == 400 and "body.spec.vectors[0].vector" in message(reply), reply
    assert call(server, "GET", "/v1/steering/spec") == (200, {"spec": None})


def test_encode_and_validate(server, baseline):
    v = vec(6)
    steering = {"spec": {"vectors": [{"layer": 1, "vector": v, "scale": 3.0}]}, "tag": "enc-1"}
    reference = encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=arr(v), scale=3.0)]), tag="enc-1")
    status, reply = call(server, "POST", "/v1/steering/encode", steering)
    assert status == 200 and reply == {"packed": reference}, reply
    assert packed(server, reply["packed"]) != baseline[PROMPTS[0]]
    status, reply = call(server, "POST", "/v1/steering/encode", {"preset": "joy", "params": {"scale": 6}})
    assert status == 200 and reply["packed"] == encode_payload(
        SteeringSpec(vectors=[AddVector(layer=1, vector=arr(JOY), scale=6)])), reply
    status, reply = call(server, "POST", "/v1/steering/validate", steering)
    assert status == 200, reply
    assert reply["request"]["spec"]["vectors"][0]["scale"] == 3.0 and reply["request"]["tag"] == "enc-1"
    assert [s["source"] for s in reply["effective"]["specs"]] == ["request"] and reply["packed"] == reference
    for body, field, fit in (({"spec": {"vectors": [{"layer": "x", "vector": v}]}}, "steering.spec.vectors[0].layer",
                              False),
                             ({"spec": {"vectors": [{"layer": 9, "vector": v}]}}, "steering.spec.vectors[0].layer",
                              True),
                             ({"preset": "joy", "params": {"scale": 99}}, "steering.params.scale", False),
                             ({"spec": {"bogus": 1}}, "steering.spec.bogus", False)):
        for route in ("validate", "encode"):
            status, reply = call(server, "POST", f"/v1/steering/{route}", body)
            if route == "encode" and fit:  # encode checks the schema, not the fit to the model
                assert status == 200, reply
                continue
            assert status == 400 and field in message(reply), (route, reply)


@pytest.mark.parametrize("extra, field", [
    ({"steering": {"spec": {"vectors": [{"layer": "x", "vector": [1.0] * HIDDEN}]}}}, "steering.spec.vectors[0].layer"),
    ({"steering": {"spec": {"vectors": [{"layer": 9, "vector": [1.0] * HIDDEN}]}}}, "steering.spec.vectors[0].layer"),
    ({"steering": {"spec": {"vectors": [{"layer": 1, "vector": [1.0] * 3}]}}}, "steering.spec.vectors[0].vector"),
    ({"steering": "nonsense"}, "steering: not a packed payload"),
    ({"steering": [1, 2]}, "steering: expected an object"),
    ({"steering": {"preset": "nobody"}}, "steering.preset"),
    ({"steering": {"preset": "joy", "params": {"scale": 17}}}, "steering.params.scale"),
    ({"steering": {"preset": "joy", "params": {"size": 1}}}, "steering.params.size"),
    ({"steering": {"preset": "joy", "spec": {}}}, "steering.spec"),
    ({"steering": {"params": {"scale": 1}}}, "steering.params"),
    ({"vllm_xargs": {"dynsteer": "{\"spec\": {\"vectors\": [{\"layer\": \"x\", \"vector\": \"v\"}]}}"}},
     "extra_args.dynsteer.spec.vectors[0].layer"),
    ({"vllm_xargs": {"dynsteer": "{not json"}}, "extra_args.dynsteer: malformed JSON"),
    ({"vllm_xargs": {"dynsteer": "hello"}}, "extra_args.dynsteer: not a packed payload"),
    ({"steering": {"spec": {}}, "vllm_xargs": {"dynsteer": "{}"}}, "steering, vllm_xargs.dynsteer"),
])
def test_malformed_forms_are_400s_naming_the_field(server, extra, field):
    msg = refused(server, extra)
    assert field in msg, msg
    if ": not a packed" in field or "expected an object" in field or "malformed" in field:
        assert "top-level 'steering' object" in msg and "'ds1:'" in msg and "preset" in msg, msg
    assert field in refused(server, extra, chat=True)


def test_bad_presets_are_400s_naming_the_field(server):
    for body, field in (({"spec": {"vectors": [{"layer": 1, "vector": JOY, "scale": "$x"}]}}, "$x"),
                        ({"spec": {"vectors": [{"layer": 9, "vector": JOY}]}}, "body.spec.vectors[0].layer"),
                        ({"spec": {"vectors": [{"layer": 1, "vector": JOY}]}, "params": {"p": {"default": 1}}},
                         "body.params.p: no '$p' placeholder"),
                        ({"spec": {"vectors": [{"layer": 1, "vector": JOY, "scale": "$p"}]},
                          "params": {"p": {"default": 20, "max": 16}}}, "default 20 is outside")):
        status, reply = call(server, "PUT", "/v1/steering/presets/bad", body)
        assert status == 400 and field in json.dumps(reply), reply
    assert "bad" not in call(server, "GET", "/v1/steering/presets")[1]["presets"]


# Every 400 of the steering routes and of a request's steering: "field: message", list indices in brackets.
# (method, route, body: a JSON value, or bytes sent as they are, field the message starts with)
_BAD = [
    ("POST", "/v1/steering/vectors", {}, "body.name: field required"),
    ("POST", "/v1/steering/vectors", {"name": "v1"}, "body.vector: field required"),
    ("POST", "/v1/steering/vectors", {"name": "v1", "vector": [1.0, "x"]}, "body.vector[1]:"),
    ("POST", "/v1/steering/vectors", {"name": "bad name!", "vector": JOY}, "body.name:"),
    ("POST", "/v1/steering/vectors", {"name": "v1", "vector": [1.0] * 3}, "body.vector:"),
    ("POST", "/v1/steering/vectors", {"name": "v1", "vector": JOY, "norm": 1}, "body.norm: unknown field"),
    ("POST", "/v1/steering/vectors", b"{not json", "body: malformed JSON"),
    ("POST", "/v1/steering/vectors", [1, 2], "body:"),
    ("PUT", "/v1/steering/policy", {"policy": 5}, "body.policy:"),
    ("PUT", "/v1/steering/policy", {"polcy": {}}, "body.polcy: unknown field"),
    ("PUT", "/v1/steering/policy", {"policy": {"monitors": [{"name": "m", "layer": "x"}]}},
     "body.policy.monitors[0]"),
    ("PUT", "/v1/steering/spec", {"spec": {"vectors": [{"layer": "x", "vector": JOY}]}},
     "body.spec.vectors[0].layer:"),
    ("PUT", "/v1/steering/spec", {"spec": {"vectors": [{"layer": 1, "vector": JOY, "scale": "big"}]}},
     "body.spec.vectors[0].scale:"),
    ("PUT", "/v1/steering/spec", {"spec": {"clamps": [{"layer": 1, "direction": JOY, "min": "a"}]}},
     "body.spec.clamps[0].min:"),
    ("PUT", "/v1/steering/spec", b"", "body:"),
    ("PUT", "/v1/steering/presets/p1", {"spec": {}, "params": {"s": {"default": "x"}}}, "body.params.s.default:"),
    ("PUT", "/v1/steering/presets/p1", {"spec": {}, "parms": {}}, "body.parms: unknown field"),
    ("PUT", "/v1/steering/presets/p1", {"spec": {"vectors": [{"layer": 9, "vector": JOY}]}},
     "body.spec.vectors[0].layer:"),
    ("POST", "/v1/steering/validate", {"spec": {"vectors": [{"layer": "x", "vector": JOY}]}},
     "steering.spec.vectors[0].layer:"),
    ("POST", "/v1/steering/validate", {"preset": "joy", "params": {"scale": 99}}, "steering.params.scale:"),
    ("POST", "/v1/steering/validate", "just a string", "steering:"),
    ("POST", "/v1/steering/encode", {"policy": {"rules": [{"monitor": "m", "actions": [
        {"kind": "add", "layer": 1, "vector": JOY, "scale": "x"}]}]}}, "steering.policy.rules[0].actions[0].scale:"),
    ("POST", "/v1/steering/encode", b"{bad", "steering: malformed JSON"),
    ("POST", "/v1/completions", {"steering": {"spec": {"vectors": [{"layer": 1, "vector": {"b64": "AAA"}}]}}},
     "steering.spec.vectors[0].vector:"),
    ("POST", "/v1/completions", {"steering": {"policy": {"monitors": [{"name": "m", "layer": -1}]}}},
     "steering.policy.monitors[0]"),
    ("POST", "/v1/completions", {"steering": {"spec": {"ablations": [{"layer": 1, "direction": JOY, "x": 1}]}}},
     "steering.spec.ablations[0].x:"),
    ("POST", "/v1/chat/completions", {"vllm_xargs": {"dynsteer": "ds1:@@@"}}, "extra_args.dynsteer:"),
    ("POST", "/v1/chat/completions", {"steering": {"spec": {"vectors": [{"layer": 1, "vector": "nobody"}]}}},
     "steering.spec.vectors[0].vector:"),
]
_PATH = re.compile(r"^[a-z_]+(\.[A-Za-z_][\w-]*|\[\d+\])*(, [a-z_.]+)?: \S")


def _raw(server, method: str, path: str, data: bytes) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    url, _ = server
    req = urllib.request.Request(f"{url}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.parametrize("method, path, body, field", _BAD, ids=[f"{m} {p} {i}" for i, (m, p, _, _) in
                                                                   enumerate(_BAD)])
def test_every_400_names_its_field_in_one_path_syntax(server, method, path, body, field):
    _, model = server
    if path == "/v1/completions":
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 2, **body}
    elif path == "/v1/chat/completions":
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    status, reply = _raw(server, method, path, body) if isinstance(body, bytes) else call(server, method, path, body)
    msg = message(reply)
    assert status == 400, (status, reply)
    assert msg.startswith(field), msg
    assert _PATH.match(msg), f"not 'field: message' in the one path syntax: {msg!r}"
    assert not re.search(r"\.\d+[.:\s]|\[\d+\]\[|'type':|'loc':", msg), msg  # no dotted indices, no raw dumps
    assert "p1" not in call(server, "GET", "/v1/steering/presets")[1]["presets"]
    assert call(server, "GET", "/v1/steering/vectors")[1]["vectors"] == [] or "v1" not in json.dumps(
        call(server, "GET", "/v1/steering/vectors")[1])


def test_openapi_documents_the_routes_and_the_steering_schema(server):
    status, doc = call(server, "GET", "/openapi.json")
    assert status == 200
    for path in ("/v1/steering/validate", "/v1/steering/encode", "/v1/steering/spec", "/v1/steering/presets",
                 "/v1/steering/presets/{name}"):
        assert path in doc["paths"], path
    schemas = doc["components"]["schemas"]
    assert {"SteeringObject", "SteeringSpec", "AddVector", "DynamicSteeringPolicy", "Preset",
            "SpecBody"} <= set(schemas)
    body = doc["paths"]["/v1/steering/validate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/SteeringObject")
    assert {"spec", "policy", "preset", "params"} <= set(schemas["SteeringObject"]["properties"])


def test_curl_example(server):
    """examples/steer_with_curl.sh against this server (last: it replaces and then deletes the preset 'joy')."""
    import subprocess
    from pathlib import Path

    url, _ = server
    script = Path(__file__).resolve().parents[1] / "examples" / "steer_with_curl.sh"
    proc = subprocess.run(["bash", str(script), url], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "KEY": KEY})
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    texts = [json.loads(line)["choices"][0]["text"] for line in proc.stdout.splitlines()
             if line.startswith("{") and '"text_completion"' in line]
    unsteered, steered, preset, global_spec, cleared = texts
    assert cleared == unsteered and len({unsteered, steered, preset, global_spec}) == 4, texts
    assert '"packed":"ds1:' in proc.stdout.replace(" ", "")
    assert call(server, "GET", "/v1/steering/presets")[1]["presets"] == {}
    assert call(server, "GET", "/v1/steering/vectors")[1]["vectors"] == []


def _node_with_openai(tmp_path):
    """A folder where ``node`` resolves the ``openai`` package (npm install from the configured registry), or a skip
    naming what is missing."""
    import shutil
    import subprocess

    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed: the Node example is not run here")
    proc = subprocess.run([npm, "install", "--silent", "--no-audit", "--no-fund", "openai@4"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"npm could not install the openai package (no registry?): {proc.stderr[-300:]}")
    return node


def test_node_example_with_the_openai_sdk(server, tmp_path):
    """examples/node/steer.mjs (the official OpenAI SDK for Node, the steering object beside the OpenAI fields):
    its steered completion and chat equal the same spec sent packed, its unsteered completion the baseline."""
    import shutil
    import subprocess
    from pathlib import Path

    node = _node_with_openai(tmp_path)
    url, model = server
    assert call(server, "POST", "/v1/steering/vectors", {"name": "nodejoy", "vector": JOY})[0] == 200
    try:
        script = tmp_path / "steer.mjs"
        shutil.copy(Path(__file__).resolve().parents[1] / "examples" / "node" / "steer.mjs", script)
        proc = subprocess.run([node, str(script), url, "nodejoy", "1", "8"], capture_output=True, text=True,
                              timeout=600, env={**__import__("os").environ, "KEY": KEY})
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        spec = encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=arr(JOY), scale=8.0)]))
        prompt, question = "The weather today is", "Describe the weather today."

        def reply(path: str, body: dict) -> dict:
            status, out = call(server, "POST", path, {"model": model, "max_tokens": 16, "temperature": 0, **body})
            assert status == 200, out
            return out["choices"][0]

        assert got["unsteered"] == reply("/v1/completions", {"prompt": prompt})["text"]
        assert got["steered"] == reply("/v1/completions", {"prompt": prompt, "vllm_xargs": {"dynsteer": spec}})["text"]
        assert got["steered"] != got["unsteered"]
        chat = reply("/v1/chat/completions", {"messages": [{"role": "user", "content": question}],
                                              "vllm_xargs": {"dynsteer": spec}})
        assert got["chat_steered"] == chat["message"]["content"]
        assert got["chat_steered"] != reply("/v1/chat/completions",
                                            {"messages": [{"role": "user", "content": question}]})["message"]["content"]
    finally:
        call(server, "DELETE", "/v1/steering/vectors/nodejoy")
