"""The OpenAI-compatible server steers per request: the packed payload rides in `vllm_xargs` (loopback only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

import dynsteer
from dynsteer import AddVector, SteeringSpec
from tests.conftest import env, openai_server


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    with env(VLLM_SERVER_DEV_MODE="1"), \
            openai_server(tiny_llama_path, tmp_path_factory.mktemp("server") / "server.log") as url:
        yield url, str(tiny_llama_path)


def complete(server, xargs=None) -> tuple[int, str]:
    url, model = server
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 10, "temperature": 0}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())["choices"][0]["text"]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_per_request_steering_through_vllm_xargs(server):
    v = (np.random.default_rng(0).standard_normal(128) * 8).astype(np.float32)
    status, base = complete(server)
    assert status == 200
    payload = dynsteer.encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=v)]))
    status, steered = complete(server, {"dynsteer": payload})
    assert status == 200 and steered != base
    assert complete(server) == (200, base)  # the next unsteered request is untouched


def test_bad_payload_is_a_400_naming_the_field(server):
    v = np.ones(128, np.float32)
    bad = dynsteer.encode_payload(SteeringSpec(vectors=[AddVector(layer=9, vector=v)]))
    status, body = complete(server, {"dynsteer": bad})
    assert status == 400 and "extra_args.dynsteer.spec.vectors[0].layer" in body
    status, body = complete(server, {"dynsteer": "ds1:not-base64!"})
    assert status == 400 and "malformed packed payload" in body
    assert complete(server)[0] == 200  # the server keeps serving


def test_dev_mode_collective_rpc_cannot_change_steering_under_plain_vllm_serve(server):
    """With dynsteer merely loaded (no steering routes), vLLM's dev-mode RPC still cannot set global steering
    behind the frontend's admission state (dynsteer's general plugin guards the route)."""
    url, _ = server
    v = (np.random.default_rng(0).standard_normal(128) * 8).astype(np.float32)
    status, base = complete(server)
    payload = dynsteer.encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=v)]))
    body = json.dumps({"method": "dynsteer_set_global", "args": [payload]}).encode()
    req = urllib.request.Request(f"{url}/collective_rpc", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 403 and "method: 'dynsteer_set_global' is not callable" in err.value.read().decode()
    assert complete(server) == (200, base)  # nothing changed
