"""``dynsteer serve``: vLLM's OpenAI server with dynsteer's steering endpoints, driven with the official ``openai``
client (one server per module, tiny Llama on CPU, ``--api-key`` set, vLLM's development routes on)."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai  # a vLLM dependency (requirements/vllm-cpu-runtime.txt pins it): never skipped
import pytest

import dynsteer
from dynsteer import Action, AddVector, DynamicSteeringPolicy, ProbeGate, Rule, SteeringSpec
from dynsteer.commands import AbortCommand
from dynsteer.config import MonitorConfig, StreamSpec
from tests.conftest import ON_GPU, dynsteer_served, env, http_json

KEY = "test-key-7f3a"
MAX_NAMED = 4  # Limits.max_named_vectors of the module's server
HIDDEN, MON_LAYER, ACT_LAYER = 128, 1, 2
PROMPTS = ["the quick brown fox", "once upon a time", "hello world, this is"]
MAX_TOKENS = 8


def vec(seed: int, scale: float = 8.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(HIDDEN) * scale).astype(np.float32)


def always_on_policy(seed: int = 1) -> DynamicSteeringPolicy:
    """A gate that is open on every generated token (threshold far below any projection)."""
    d = np.eye(HIDDEN, dtype=np.float32)[0]
    return DynamicSteeringPolicy(
        monitors=[ProbeGate(name="m", layer=MON_LAYER, direction=d, sharpness=4.0, threshold=-1e3)],
        rules=[Rule(monitor="m", actions=[Action(kind="add", layer=ACT_LAYER, vector=vec(seed))])])


@pytest.fixture(scope="module")
def monitor_cfg() -> MonitorConfig:
    """The module server's async tier: stream ``resid`` (every request's generated tokens at layer 1)."""
    return MonitorConfig.private(streams={"resid": StreamSpec(places=("1.post_block",), requests="all",
                                                             positions="generated")})


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory, monitor_cfg):
    """``dynsteer serve`` on a free loopback port, with vLLM's development routes (``/collective_rpc``, ...); yields
    (base url, model)."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cfg = {"max_gates": 2, "max_rows": 16, "limits": {"max_named_vectors": MAX_NAMED}, "capture_sites": ["post_block"],
           "capture_layers": [1], "monitor": monitor_cfg.model_dump(mode="json")}
    with env(VLLM_SERVER_DEV_MODE="1"), dynsteer_served(tiny_llama_path, log, KEY, cfg) as url:
        yield url, str(tiny_llama_path)


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def steering(server, method: str, path: str, body=None, key: str | None = KEY) -> tuple[int, dict]:
    url, _ = server
    return http_json(f"{url}/v1/steering/{path}", method, body, key)


def rpc(server, method: str, args=(), key: str | None = KEY, path: str = "collective_rpc") -> tuple[int, dict]:
    """A call to one of vLLM's development routes (``/collective_rpc`` by default)."""
    url, _ = server
    return http_json(f"{url}/{path}", "POST", {"method": method, "args": list(args)}, key, empty={})


def complete(client, model: str, prompt: str = PROMPTS[0], payload: str | None = None) -> str:
    extra = None if payload is None else {"vllm_xargs": {"dynsteer": payload}}
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body=extra)
    return out.choices[0].text


def error_message(body: dict) -> str:
    err = body.get("error", body)
    return err.get("message", "") if isinstance(err, dict) else str(err)


@pytest.fixture(scope="module")
def baseline(server, client):
    _, model = server
    return [complete(client, model, p) for p in PROMPTS]


def test_capabilities(server):
    status, caps = steering(server, "GET", "capabilities")
    assert status == 200, caps
    assert caps["hidden_size"] == HIDDEN and caps["num_layers"] == 4 and caps["layers"] == [0, 1, 2, 3]
    assert caps["sites"] == ["pre_attn", "post_attn", "post_block"] and caps["max_gates"] == 2 and caps["dynamic"]
    assert caps["limits"]["max_payload_bytes"] == 4 << 20 and caps["max_rows"] == 16


def test_per_request_policy_and_spec_change_output_and_leave_unsteered_alone(server, client, baseline):
    _, model = server
    policy = dynsteer.encode_payload(policy=always_on_policy())
    spec = dynsteer.encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=vec(3))]))
    assert complete(client, model, payload=policy) != baseline[0]
    assert complete(client, model, payload=spec) != baseline[0]
    assert [complete(client, model, p) for p in PROMPTS] == baseline
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, extra_body={"vllm_xargs": {"dynsteer": policy}})
    assert chat.choices[0].message.content is not None


def test_global_policy_set_get_clear_restores_the_baseline(server, client, baseline):
    _, model = server
    body = always_on_policy().model_dump(mode="json", exclude_none=True)
    status, reply = steering(server, "PUT", "policy", {"policy": body})
    assert status == 200 and reply["policy"]["monitors"][0]["name"] == "m", reply
    try:
        assert steering(server, "GET", "policy")[1]["policy"]["rules"][0]["monitor"] == "m"
        steered = [complete(client, model, p) for p in PROMPTS]
        assert steered != baseline  # every request without its own policy is steered now
    finally:
        status, reply = steering(server, "DELETE", "policy")
    assert status == 200 and reply == {"policy": None}
    assert steering(server, "GET", "policy") == (200, {"policy": None})
    assert [complete(client, model, p) for p in PROMPTS] == baseline


def test_named_vectors_register_list_use_delete(server, client, baseline):
    _, model = server
    v = vec(5)
    status, info = steering(server, "POST", "vectors", {"name": "joy", "vector": dynsteer.vectors.pack_vector(v)})
    assert status == 200 and info["name"] == "joy" and abs(info["norm"] - float(np.linalg.norm(v))) < 1e-3
    status, listed = steering(server, "POST", "vectors", {"name": "calm", "vector": [0.5] * HIDDEN})
    assert status == 200
    names = [x["name"] for x in steering(server, "GET", "vectors")[1]["vectors"]]
    assert names == ["calm", "joy"]
    by_name = dynsteer.encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector="joy")]))
    inline = dynsteer.encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=v)]))
    steered = complete(client, model, payload=by_name)
    assert steered != baseline[0] and steered == complete(client, model, payload=inline)
    # a global policy naming a vector keeps it from being deleted
    pol = always_on_policy().model_dump(mode="json", exclude_none=True)
    pol["rules"][0]["actions"][0]["vector"] = "calm"
    assert steering(server, "PUT", "policy", {"policy": pol})[0] == 200
    status, body = steering(server, "DELETE", "vectors/calm")
    assert status == 409 and "calm" in error_message(body)
    status, body = steering(server, "POST", "vectors", {"name": "calm", "vector": [0.25] * HIDDEN})
    assert status == 409 and "replacing" in error_message(body)
    assert steering(server, "DELETE", "policy")[0] == 200
    assert steering(server, "DELETE", "vectors/calm") == (200, {"deleted": "calm"})
    assert steering(server, "DELETE", "vectors/joy") == (200, {"deleted": "joy"})
    assert steering(server, "DELETE", "vectors/joy")[0] == 404
    with pytest.raises(openai.BadRequestError) as err:  # an unregistered name is a 400 naming the field
        complete(client, model, payload=by_name)
    assert "extra_args.dynsteer.spec.vectors[0].vector" in str(err.value)
    assert [complete(client, model, p) for p in PROMPTS] == baseline


def test_a_monitor_handshake_then_frames_and_an_abort_by_the_id_the_response_shows(server, client, monitor_cfg):
    """The served start handshake (``GET /v1/steering/streams/{name}/subscribers``), and a monitor that aborts the
    first request it sees by its user id: the id the chat completion's response carries."""
    import threading

    from dynsteer.monitor.client import MonitorClient

    url, model = server
    status, reply = steering(server, "GET", "streams/resid/subscribers?timeout_s=0.2")
    assert status == 504 and error_message(reply).startswith("timeout_s: 0 of 1 subscribers connected to stream "
                                                             "'resid'"), reply
    seen: dict[str, object] = {}
    with MonitorClient(monitor_cfg.endpoint, monitor_cfg.command_endpoint, name="srv-mon", streams=["resid"]) as mon:
        def watch() -> None:
            frame = mon.recv(120)
            if frame is not None:
                seen["user"], seen["engine"] = frame.user_ids[0], frame.req_ids[0]
                seen["ack"] = mon.send(AbortCommand(request=frame.user_ids[0], reason="seen")).ack(60)

        status, reply = steering(server, "GET", "streams/resid/subscribers?min=1&timeout_s=60")
        assert status == 200 and reply == {"stream": "resid", "subscribers": ["srv-mon"], "ready": True}, reply
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
        watcher.join(120)
    ack = seen["ack"]
    assert seen["user"] == chat.id and str(seen["engine"]).startswith(chat.id + "-")
    assert ack.status == "applied" and ack.request == seen["engine"], ack
    assert chat.choices[0].finish_reason != "length" and chat.usage.completion_tokens < 200


def test_steering_endpoints_refuse_without_the_key(server):
    for method, path, body in [("GET", "capabilities", None), ("GET", "vectors", None), ("GET", "policy", None),
                               ("PUT", "policy", {"policy": None}), ("DELETE", "policy", None),
                               ("POST", "vectors", {"name": "x", "vector": [0.0] * HIDDEN}),
                               ("DELETE", "vectors/x", None)]:
        for key in (None, "wrong-key", KEY + "x"):
            status, _ = steering(server, method, path, body, key=key)
            assert status == 401, (method, path, key, status)
    assert steering(server, "GET", "vectors")[1]["vectors"] == []  # nothing was registered


def test_dev_mode_collective_rpc_needs_the_key_and_never_changes_steering(server, client, baseline):
    """VLLM_SERVER_DEV_MODE's /collective_rpc lies outside vLLM's --api-key prefixes and reaches every worker method:
    under dynsteer serve it answers only with the key, and refuses dynsteer's state-changing methods even then."""
    _, model = server
    packed = dynsteer.vectors.pack_vector(vec(9))
    set_global = dynsteer.encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=vec(9))]))
    attacks = [("dynsteer_register_vector", ["evil", packed]), ("dynsteer_set_global", [set_global]),
               ("dynsteer_unregister_vector", ["evil"]), ("dynsteer_take_captures", [["t"]]),
               ("dynsteer_describe", []), ("get_model_inspection", [])]
    for key in (None, "wrong-key"):
        for method, args in attacks:
            status, body = rpc(server, method, args, key=key)
            assert status == 401, (method, key, status, body)
        assert rpc(server, "", key=key, path="reset_prefix_cache")[0] == 401  # every dev route
    for method, args in attacks[:4]:  # with the key: dynsteer's state changes are for /v1/steering/* only
        status, body = rpc(server, method, args)
        assert status == 403 and error_message(body).startswith(f"method: '{method}' is not callable"), body
    status, body = rpc(server, "dynsteer_describe")  # reading is fine with the key
    assert status == 200, body
    (rank,) = body["results"]
    assert rank["named_vectors"] == [] and rank["global_empty"], rank
    assert steering(server, "GET", "vectors")[1]["vectors"] == []
    assert [complete(client, model, p) for p in PROMPTS] == baseline  # no global steering crept in


def test_named_vector_limit_over_http(server, client, baseline):
    """max_named_vectors: a new name over the limit is a 409 naming ``name``; the frontend and the workers keep the
    same names; replacing a registered name is fine."""
    _, model = server
    names = [f"lim-{i}" for i in range(MAX_NAMED)]
    try:
        for i, name in enumerate(names):
            assert steering(server, "POST", "vectors", {"name": name, "vector": [0.1 * (i + 1)] * HIDDEN})[0] == 200
        status, body = steering(server, "POST", "vectors", {"name": "one-too-many", "vector": [0.5] * HIDDEN})
        assert status == 409 and error_message(body).startswith("name: cannot register 'one-too-many'"), body
        assert f"max_named_vectors = {MAX_NAMED}" in error_message(body)
        assert steering(server, "POST", "vectors", {"name": names[0], "vector": [0.7] * HIDDEN})[0] == 200
        listed = [v["name"] for v in steering(server, "GET", "vectors")[1]["vectors"]]
        workers = rpc(server, "dynsteer_describe")[1]["results"][0]["named_vectors"]
        assert listed == sorted(workers) == names
        info = {v["name"]: v for v in steering(server, "GET", "vectors")[1]["vectors"]}
        assert abs(info[names[0]]["norm"] - 0.7 * HIDDEN ** 0.5) < 1e-3
    finally:
        for name in names:
            steering(server, "DELETE", f"vectors/{name}")
    assert steering(server, "GET", "vectors")[1]["vectors"] == []
    assert rpc(server, "dynsteer_describe")[1]["results"][0]["named_vectors"] == []
    assert [complete(client, model, p) for p in PROMPTS] == baseline


@pytest.mark.parametrize("method,path,body,field", [
    ("POST", "vectors", {"name": "v", "vector": [1.0] * 7}, "vector"),
    ("POST", "vectors", {"name": "../etc", "vector": [1.0] * HIDDEN}, "name"),
    ("POST", "vectors", {"name": "v", "vector": {"b64": "!!"}}, "vector"),
    ("POST", "vectors", {"name": "v", "vector": [float("nan")] * HIDDEN}, "vector"),
    ("POST", "vectors", {"name": "v"}, "vector"),
    ("POST", "vectors", {"name": "v", "vector": [1.0] * HIDDEN, "path": "/etc"}, "path"),
    ("PUT", "policy", {"policy": {"monitors": [], "rules": [], "bogus": 1}}, "body.policy.bogus"),
    ("PUT", "policy", {"policy": "nope"}, "policy"),
    ("PUT", "policy", None, "body"),
])
def test_malformed_bodies_are_400s_naming_the_field(server, method, path, body, field):
    status, reply = steering(server, method, path, body)
    assert status == 400, reply
    assert field in error_message(reply) or field in json.dumps(reply), reply


def test_policy_that_does_not_fit_the_model_is_a_400_naming_the_field(server, client, baseline):
    _, model = server
    bad = always_on_policy().model_dump(mode="json", exclude_none=True)
    bad["monitors"][0]["direction"] = [1.0] * 7
    status, reply = steering(server, "PUT", "policy", {"policy": bad})
    assert status == 400 and "body.policy.monitors[0].direction" in error_message(reply), reply
    bad = always_on_policy().model_dump(mode="json", exclude_none=True)
    bad["monitors"][0]["layer"], bad["rules"][0]["actions"][0]["layer"] = 9, 9
    status, reply = steering(server, "PUT", "policy", {"policy": bad})
    assert status == 400 and "layer" in error_message(reply) and "9" in error_message(reply), reply
    bad = always_on_policy().model_dump(mode="json", exclude_none=True)
    bad["rules"][0]["actions"][0]["vector"] = "nobody"
    status, reply = steering(server, "PUT", "policy", {"policy": bad})
    assert status == 400 and "body.policy.rules[0].actions[0].vector" in error_message(reply), reply
    assert steering(server, "GET", "policy") == (200, {"policy": None})  # nothing changed
    assert complete(client, model) == baseline[0]


def test_loopback_rule_without_a_key():
    """No API key: loopback and unix-socket clients are served, others get 403 unless the operator opted in."""
    from types import SimpleNamespace

    from fastapi import HTTPException

    from dynsteer.engine.server import SteeringEndpoints

    def request(host, headers=None):
        return SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(dynsteer={"keys": []})),
                               client=None if host is None else SimpleNamespace(host=host), headers=headers or {})

    local = SteeringEndpoints()
    for host in ("127.0.0.1", "::1", None):
        asyncio.run(local.authorize(request(host)))
    for host in ("10.0.0.7", "192.168.1.2", "2001:db8::1", "not-an-ip"):
        with pytest.raises(HTTPException) as err:
            asyncio.run(local.authorize(request(host)))
        assert err.value.status_code == 403
    asyncio.run(SteeringEndpoints(allow_remote=True).authorize(request("10.0.0.7")))
    # with a key, dynsteer checks it itself (whatever prefix vLLM's own middleware guards), from any address
    import hashlib

    keyed = request("127.0.0.1")
    keyed.app.state.dynsteer["keys"] = [hashlib.sha256(KEY.encode()).digest()]
    for header in ({}, {"authorization": "Bearer nope"}, {"authorization": f"Basic {KEY}"}):
        keyed.headers = header
        with pytest.raises(HTTPException) as err:
            asyncio.run(local.authorize(keyed))
        assert err.value.status_code == 401
    keyed.headers, keyed.client.host = {"authorization": f"Bearer {KEY}"}, "10.0.0.7"
    asyncio.run(local.authorize(keyed))


def test_load_mixed_traffic(server, baseline):
    """≥ 200 requests, 16 at a time: unsteered, per-request static and per-request policy steering mixed; no
    errors, unsteered texts equal the baseline, steered ones are deterministic; latency percentiles recorded."""
    url, model = server
    n, concurrency = 240, 16
    spec = dynsteer.encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=vec(3))]))
    policy = dynsteer.encode_payload(policy=always_on_policy())
    kinds = ["unsteered", "static", "policy"]
    jobs = [(kinds[i % 3], PROMPTS[(i // 3) % len(PROMPTS)]) for i in range(n)]

    async def run() -> list[tuple[str, str, str, float]]:
        sem = asyncio.Semaphore(concurrency)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300) as c:
            async def one(kind: str, prompt: str):
                payload = {"static": spec, "policy": policy}.get(kind)
                extra = None if payload is None else {"vllm_xargs": {"dynsteer": payload}}
                async with sem:
                    t0 = time.perf_counter()
                    out = await c.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, extra_body=extra)
                    return kind, prompt, out.choices[0].text, time.perf_counter() - t0

            return await asyncio.gather(*(one(k, p) for k, p in jobs))

    t0 = time.perf_counter()
    results = asyncio.run(run())  # any HTTP error raises here
    wall = time.perf_counter() - t0
    assert len(results) == n
    base = dict(zip(PROMPTS, baseline))
    by = {}
    for kind, prompt, text, _ in results:
        by.setdefault((kind, prompt), set()).add(text)
    for prompt in PROMPTS:
        assert by[("unsteered", prompt)] == {base[prompt]}
        for kind in ("static", "policy"):
            assert len(by[(kind, prompt)]) == 1 and by[(kind, prompt)] != {base[prompt]}, (kind, prompt)
    lat = np.array([r[3] for r in results]) * 1e3
    p50, p95, p99 = (float(np.percentile(lat, q)) for q in (50, 95, 99))
    record = {"test": "tests/test_serve.py::test_load_mixed_traffic", "requests": n, "concurrency": concurrency,
              "mix": "1/3 unsteered, 1/3 per-request static vector, 1/3 per-request dynamic policy",
              "max_tokens": MAX_TOKENS, "errors": 0, "wall_s": round(wall, 2), "throughput_rps": round(n / wall, 2),
              "latency_ms": {"p50": round(p50, 1), "p95": round(p95, 1), "p99": round(p99, 1),
                             "max": round(float(lat.max()), 1)},
              "model": "tiny random Llama (4 layers, hidden 128)", "device": "cuda" if ON_GPU else "cpu",
              "cpus": os.cpu_count(), "cpu_model": _cpu_model(),
              "load_average_1m": round(os.getloadavg()[0], 2),
              "date": datetime.date.today().isoformat(), "dynsteer": dynsteer.__version__}
    print("\nserve load test:", json.dumps(record))
    out = os.environ.get("DYNSTEER_SERVE_LOAD_JSON")
    if out:
        Path(out).write_text(json.dumps(record, indent=2) + "\n")


def test_policy_changes_under_traffic(server, baseline):
    """The global policy set and cleared 6 times while 48 requests are in flight: every request succeeds, every
    change lands, and once cleared the unsteered outputs equal the baseline again."""
    url, model = server
    body = {"policy": always_on_policy(7).model_dump(mode="json", exclude_none=True)}

    async def run() -> list[int]:
        import httpx

        headers = {"Authorization": f"Bearer {KEY}"}
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300) as c, \
                httpx.AsyncClient(base_url=f"{url}/v1/steering", headers=headers, timeout=120) as h:
            async def one(i: int) -> str:
                out = await c.completions.create(model=model, prompt=PROMPTS[i % 3], max_tokens=MAX_TOKENS,
                                                 temperature=0)
                return out.choices[0].text

            async def toggle() -> list[int]:
                codes = []
                for i in range(6):
                    r = await (h.put("/policy", json=body) if i % 2 == 0 else h.delete("/policy"))
                    codes.append(r.status_code)
                    await asyncio.sleep(0.05)
                return codes

            *texts, codes = await asyncio.gather(*(one(i) for i in range(48)), toggle())
            assert len(texts) == 48 and all(isinstance(t, str) for t in texts)
            return codes

    assert asyncio.run(run()) == [200] * 6
    assert steering(server, "GET", "policy") == (200, {"policy": None})
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        assert [complete(c, model, p) for p in PROMPTS] == baseline


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def test_openai_client_example(server, baseline):
    url, _ = server
    script = Path(__file__).resolve().parents[1] / "examples" / "openai_client.py"
    proc = subprocess.run([sys.executable, str(script), "--base-url", url, "--api-key", KEY, "--prompt", PROMPTS[0],
                           "--max-tokens", str(MAX_TOKENS)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(":", 1) for line in proc.stdout.splitlines() if ":" in line)
    assert lines["unsteered "].strip() == lines["cleared   "].strip() == baseline[0].strip()
    assert lines["steered   "].strip() != lines["unsteered "].strip()
    assert lines["global    "].strip() == lines["policy    "].strip() != lines["unsteered "].strip()
    assert "HTTP 400" in proc.stdout and "vector" in lines["a bad vector"]
    assert steering(server, "GET", "vectors")[1]["vectors"] == []  # the example cleaned up
