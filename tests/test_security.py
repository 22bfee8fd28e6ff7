"""Requests are untrusted (architecture §10): tried as an attacker would, in process and over HTTP on loopback.

Every case is rejected with the field named (a 400 over HTTP), or, when it can only show at run time, the request
alone is stopped with the reason; other requests stay byte-identical and the engine keeps serving.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
import pytest

import dynsteer
from dynsteer import (Action, AddVector, CaptureSpec, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, ProjectionClamp,
                      Rule, SteeringSpec)
from dynsteer.config import Limits
from dynsteer.request.payload import encode_payload, with_tag
from tests.conftest import make_llm, openai_server, token_ids

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning", "she opened the door and"]
HIDDEN, MON_LAYER, ACT_LAYER = 128, 1, 2
LIMITS = Limits(max_payload_bytes=64 << 10, max_entries=64, max_named_vectors=4)



def greedy(n: int = 12):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def vec(seed: int, scale: float = 6.0) -> np.ndarray:
    return (np.random.default_rng(100 + seed).standard_normal(HIDDEN) * scale).astype(np.float32)


def pack_raw(body: dict) -> str:
    """A packed payload built from raw JSON-like data, as a client that skips dynsteer's schema would send it."""
    return "ds1:" + base64.b64encode(msgspec.msgpack.encode(body)).decode()


def deep_msgpack(levels: int = 100_000) -> str:
    """``{"spec": [[[...]]]}`` nested ``levels`` deep, written as raw msgpack bytes (no encoder nests that far)."""
    return "ds1:" + base64.b64encode(b"\x81\xa4spec" + b"\x91" * levels + b"\x90").decode()


def policy_body(**controller) -> dict:
    """A valid policy as JSON, with ``controller`` fields to tamper with."""
    d = np.eye(HIDDEN, dtype=np.float32)[0]
    pol = DynamicSteeringPolicy(
        monitors=[ProbeGate(name="m", layer=MON_LAYER, direction=d, sharpness=4.0, threshold=-100.0)],
        rules=[Rule(monitor="m", actions=[Action(kind="add", layer=ACT_LAYER, vector=vec(1))])])
    body = pol.model_dump(mode="json", exclude_none=True)
    if controller:
        body["controller"] = controller
    return body


def engine_config(root: Path, probe: Path) -> DynsteerConfig:
    return DynsteerConfig(max_rows=4, max_gates=2, capture_sites=("post_block",), capture_layers=(MON_LAYER,),
                          capture_consumers={"memory": {}, "filesystem": {"root": str(root / "caps")}},
                          controllers={"nan_after": "dynsteer.testing.controllers:NanAfter"},
                          probes={"sent": str(probe)},
                          limits=LIMITS)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from dynsteer.probefile.fileformat import save_probe

    root = tmp_path_factory.mktemp("sec")
    probe = save_probe(root / "sent.safetensors", vec(7, 0.05), bias=0.0, model_id="tiny", layer=MON_LAYER)
    return root, Path(probe)


@pytest.fixture(scope="module")
def engine(tiny_llama_path, files):
    root, probe = files
    with make_llm(tiny_llama_path, enable_prefix_caching=True, **engine_config(root, probe).engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        yield llm, st, token_ids(llm.generate(PROMPTS, greedy()))


def run_batch(llm, payloads: list) -> tuple[dict[int, str], dict[int, object]]:
    """Submit one request per payload (None: unsteered) to the engine one by one, like a server does: returns
    the rejections (index -> message) and the finished outputs (index -> RequestOutput)."""
    engine = llm.llm_engine
    rejected, ids = {}, {}
    for i, payload in enumerate(payloads):
        params = greedy()
        if payload is not None:
            params.extra_args = {"dynsteer": payload}
        try:
            engine.add_request(f"r{i}-{time.monotonic_ns()}", PROMPTS[i % len(PROMPTS)], params)
        except ValueError as exc:
            rejected[i] = str(exc)
        else:
            ids[i] = None
    outputs = {}
    by_id = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                by_id[out.request_id] = out
    for rid, out in by_id.items():
        outputs[int(rid.split("-")[0][1:])] = out
    return rejected, outputs


def assert_serving(llm, baseline) -> None:
    assert token_ids(llm.generate(PROMPTS, greedy())) == baseline


def scheduler_of(llm):
    """The engine core's scheduler when it runs in this process (CPU tests); ``None`` on GPU (its own process)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return None if core is None else core.scheduler


# ---- code execution and file access -------------------------------------------------------------------------------
def test_import_paths_are_refused_and_nothing_runs(engine, tmp_path):
    llm, st, baseline = engine
    marker = tmp_path / "pwned"
    cases = {
        "extra_args.dynsteer.policy.controller: factory: import paths are not accepted":
            policy_body(kind="custom", factory="subprocess:getoutput", options={"cmd": f"touch {marker}"}),
        "extra_args.dynsteer.policy.controller.name: controller name 'subprocess:getoutput' is not a valid name":
            policy_body(kind="custom", name="subprocess:getoutput", options={"cmd": f"touch {marker}"}),
        "extra_args.dynsteer.policy.controller.name: unknown controller 'os'":
            policy_body(kind="custom", name="os", options={"name": str(marker)}),
    }
    for message, body in cases.items():
        for payload in (pack_raw({"policy": body}), {"policy": body}):
            rejected, outputs = run_batch(llm, [None, payload, None])
            assert message in rejected[1], rejected
            assert [list(outputs[i].outputs[0].token_ids) for i in (0, 2)] == [baseline[0], baseline[2]]
    assert not marker.exists()
    assert_serving(llm, baseline)


def test_probe_files_only_by_registered_name(engine, files):
    llm, st, baseline = engine
    root, probe = files
    messages = set()
    for path in (str(probe), "/etc/passwd", "/no/such/file"):  # same answer whether or not the file exists
        body = policy_body()
        body["monitors"] = [{"name": "m", "layer": MON_LAYER, "probe_file": path}]
        rejected, _ = run_batch(llm, [pack_raw({"policy": body})])
        messages.add(rejected[0])
    assert len(messages) == 1
    assert "extra_args.dynsteer.policy.monitors[0].probe_file: file paths are not accepted in requests" in \
        messages.pop()
    body = policy_body()
    body["monitors"] = [{"name": "m", "layer": MON_LAYER, "probe": "secret"}]
    rejected, _ = run_batch(llm, [pack_raw({"policy": body})])
    assert "extra_args.dynsteer.policy.monitors[0].probe: unknown probe 'secret' (registered: sent" in rejected[0]
    # the registered probe runs, and its gate is the probe file's probability (the monitor resolves to it)
    pol = DynamicSteeringPolicy(monitors=[ProbeGate(name="m", layer=MON_LAYER, probe="sent")],
                                rules=[Rule(monitor="m", actions=[Action(kind="add", layer=ACT_LAYER, vector=vec(1))])])
    out = st.generate(PROMPTS[:1], greedy(), policy=pol)[0]
    assert out.trace is not None and len(out.trace) > 0
    assert_serving(llm, baseline)


def test_capture_tags_cannot_leave_the_capture_root(engine, files):
    llm, st, baseline = engine
    root, _ = files
    before = sorted(p for p in root.parent.rglob("*") if "caps" not in p.parts)
    body = encode_payload(SteeringSpec(), capture=CaptureSpec(layers=(MON_LAYER,), consumers=("filesystem",)))
    for tag in ("../x", "../../escape", "/tmp/abs-path", "a/b", ".hidden", "x" * 200, "a b"):
        rejected, _ = run_batch(llm, [with_tag(body, tag)])
        assert rejected[0].startswith("extra_args.dynsteer.tag: tag"), rejected
        raw = msgspec.msgpack.decode(base64.b64decode(body[4:]))
        rejected, _ = run_batch(llm, [pack_raw({**raw, "tag": tag})])
        assert rejected[0].startswith("extra_args.dynsteer.tag: tag"), rejected
    assert sorted(p for p in root.parent.rglob("*") if "caps" not in p.parts) == before
    assert not Path("/tmp/abs-path.json").exists() and not Path("/tmp/abs-path.bin").exists()
    rejected, outputs = run_batch(llm, [with_tag(body, "fine-tag.1")])  # a safe tag writes under the root
    assert not rejected
    assert_serving(llm, baseline)  # the workers learn that the request finished (and write it) at the next step
    assert (root / "caps" / "fine-tag.1.json").exists()


def test_capture_naming_an_unknown_consumer_is_rejected_at_admission(engine):
    """The frontend knows the engine's configured consumers (memory, filesystem): a capture naming another one is a
    400 naming the field, not a capture that ends ``partial``."""
    llm, st, baseline = engine
    for consumers, index in ((("nope",), 0), (("memory", "zmq"), 1), (("filesystem", "../../etc/passwd"), 1)):
        body = encode_payload(SteeringSpec(), capture=CaptureSpec(layers=(MON_LAYER,), consumers=consumers))
        rejected, outputs = run_batch(llm, [None, body, None])
        assert rejected[1].startswith(f"extra_args.dynsteer.capture.consumers[{index}]: unknown consumer"), rejected
        assert "configured: filesystem, memory" in rejected[1]
        assert [list(outputs[i].outputs[0].token_ids) for i in (0, 2)] == [baseline[0], baseline[2]]
    ok = encode_payload(SteeringSpec(), capture=CaptureSpec(layers=(MON_LAYER,), consumers=("memory",)))
    rejected, outputs = run_batch(llm, [with_tag(ok, "known-consumer")])
    assert not rejected and list(outputs[0].outputs[0].token_ids) == baseline[0]
    assert_serving(llm, baseline)


# ---- values that would overflow -----------------------------------------------------------------------------------
def test_gate_parameters_stay_finite_in_float32(engine):
    """A monitor's sharpness and threshold land in float32 tables: values float32 cannot hold (or that round to a
    slope of 0) are rejected naming the field; probes with real weight norms still run."""
    llm, st, baseline = engine
    for field, value in (("sharpness", 1e300), ("sharpness", 1e-300), ("threshold", 1e300), ("threshold", -1e40)):
        body = policy_body()
        body["monitors"][0][field] = value
        rejected, outputs = run_batch(llm, [None, pack_raw({"policy": body}), None])
        assert rejected[1].startswith(f"extra_args.dynsteer.policy.monitors[0].{field}: "), rejected
        assert [list(outputs[i].outputs[0].token_ids) for i in (0, 2)] == [baseline[0], baseline[2]]
    w = vec(8, 20.0).astype(np.float64)  # a weight norm of a few hundred, as trained probes have
    mon = ProbeGate(name="m", layer=MON_LAYER, direction=w / np.linalg.norm(w), sharpness=float(np.linalg.norm(w)),
                  threshold=-1e9)
    assert 100 < mon.sharpness < 1000
    pol = DynamicSteeringPolicy(monitors=[mon],
                                rules=[Rule(monitor="m", actions=[Action(kind="add", layer=ACT_LAYER, vector=vec(1))])])
    rejected, outputs = run_batch(llm, [encode_payload(policy=pol)])
    assert not rejected and outputs[0].outputs[0].finish_reason == "length"
    assert_serving(llm, baseline)


def test_values_that_overflow_are_rejected_and_never_reach_other_requests(engine):
    llm, st, baseline = engine
    big = dict(kind="latch", on=0.0, off=0.0, scale=1e38)
    spec = lambda **kw: {"spec": SteeringSpec(**kw).model_dump(mode="json")}  # noqa: E731
    cases = [
        ({"policy": policy_body(**big)}, "extra_args.dynsteer.policy.controller.scale: the controller can output"),
        (spec(vectors=[AddVector(layer=1, vector=vec(0), scale=1e38)]),
         "extra_args.dynsteer.spec.vectors[0].scale: the entry adds up to"),
        (spec(vectors=[AddVector(layer=1, vector=np.full(HIDDEN, 1e30, np.float32))]),
         "extra_args.dynsteer.spec.vectors[0].scale: the entry adds up to"),
        (spec(vectors=[AddVector(layer=i % 4, vector=np.full(HIDDEN, 2500.0, np.float32)) for i in range(6)]),
         "extra_args.dynsteer.spec.vectors[4].scale: with this entry the configuration adds up to"),
        (spec(clamps=[ProjectionClamp(layer=1, direction=vec(0), lo=-1e30, hi=0.0)]),
         "extra_args.dynsteer.spec.clamps[0].lo: |lo| = 1e+30 exceeds"),
        (spec(clamps=[ProjectionClamp(layer=1, direction=vec(0), hi=0.0, strength=50.0)]),
         "extra_args.dynsteer.spec.clamps[0].strength: 50 exceeds"),
    ]
    for body, message in cases:
        rejected, outputs = run_batch(llm, [None, pack_raw(body), None])
        assert message in rejected[1], rejected
        assert [list(outputs[i].outputs[0].token_ids) for i in (0, 2)] == [baseline[0], baseline[2]]
    # the strongest steering the limits allow runs, stays finite, and leaves its batch-mates untouched
    strongest = SteeringSpec(vectors=[AddVector(layer=0, vector=np.full(HIDDEN, 9999.0, np.float32))])
    rejected, outputs = run_batch(llm, [None, encode_payload(strongest), None, None])
    assert not rejected and outputs[1].outputs[0].finish_reason == "length"
    assert [list(outputs[i].outputs[0].token_ids) for i in (0, 2, 3)] == [baseline[0], baseline[2], baseline[3]]
    assert_serving(llm, baseline)


def test_strict_types_never_coerce(engine):
    llm, st, baseline = engine
    good = AddVector(layer=1, vector=vec(0)).model_dump(mode="json")
    for field, value in (("layer", "1"), ("layer", 1.0), ("layer", True), ("scale", "2"), ("scale", True)):
        rejected, _ = run_batch(llm, [pack_raw({"spec": {"vectors": [{**good, field: value}]}})])
        assert rejected[0].startswith(f"extra_args.dynsteer.spec.vectors[0].{field}:"), rejected
    bad_vec = {**good, "vector": {"b64": "not base64!"}}
    rejected, _ = run_batch(llm, [pack_raw({"spec": {"vectors": [bad_vec]}})])
    assert rejected[0].startswith("extra_args.dynsteer.spec.vectors[0].vector: expected a registered vector name or an "
                                  "inline vector"), rejected
    assert_serving(llm, baseline)


# ---- resource limits --------------------------------------------------------------------------------------------------
def test_oversize_deep_and_wide_payloads_are_rejected_cheaply(engine):
    llm, st, baseline = engine
    nested: dict = {"spec": {"vectors": []}}
    node = nested["spec"]["vectors"]
    for _ in range(40):
        node.append([])
        node = node[0]
    cases = [
        ("ds1:" + "A" * (LIMITS.max_payload_bytes + 1), "extra_args.dynsteer: payload of"),
        (pack_raw({"spec": {"vectors": [{"layer": 1, "vector": "v"}] * 65}}),
         "extra_args.dynsteer: payload holds more than the engine's limit max_entries = 64"),
        (pack_raw(nested), "extra_args.dynsteer: payload nests deeper than the engine's limit max_depth = 16"),
        (pack_raw({"spec": {"vectors": []}, "capture": {"layers": [1], "positions": list(range(70_000))}}),
         "extra_args.dynsteer: payload of"),  # over the byte limit before anything is decoded
    ]
    t0 = time.perf_counter()
    for payload, message in cases:
        rejected, _ = run_batch(llm, [payload])
        assert message in rejected[0], rejected
    # deeply nested msgpack (100k levels): rejected as malformed or too deep, never a crash or a recursion error
    rejected, _ = run_batch(llm, [deep_msgpack()])
    assert rejected[0].startswith("extra_args.dynsteer"), rejected
    assert time.perf_counter() - t0 < 30
    assert_serving(llm, baseline)


def test_exactly_max_entries_are_admitted_and_one_more_is_not(engine):
    """max_entries counts entries, not the payload's wrappers: 64 steering entries run, 65 are refused."""
    llm, st, baseline = engine
    entries = [AddVector(layer=i % 4, site=("pre_attn", "post_attn", "post_block")[i % 3], vector=vec(60 + i, 0.5))
               for i in range(LIMITS.max_entries)]
    rejected, outputs = run_batch(llm, [None, encode_payload(SteeringSpec(vectors=entries)), None])
    assert not rejected and outputs[1].outputs[0].finish_reason == "length"
    assert [list(outputs[i].outputs[0].token_ids) for i in (0, 2)] == [baseline[0], baseline[2]]
    over = SteeringSpec(vectors=[*entries, AddVector(layer=0, vector=vec(59, 0.5))])
    rejected, _ = run_batch(llm, [encode_payload(over)])
    assert "extra_args.dynsteer: payload holds more than the engine's limit max_entries = 64" in rejected[0]
    assert_serving(llm, baseline)


def test_named_vectors_are_bounded_and_a_refusal_changes_nothing(engine):
    """Steerer.register_vector within Limits.max_named_vectors: a new name over the limit is refused naming
    ``name`` before any rank changes; replacing a registered name is fine."""
    llm, st, baseline = engine
    names = [f"lim-{i}" for i in range(LIMITS.max_named_vectors - len(st.named_vectors))]
    try:
        for i, name in enumerate(names):
            st.register_vector(name, vec(70 + i))
        before = (sorted(st.named_vectors), [sorted(d["named_vectors"]) for d in st.describe()])
        with pytest.raises(dynsteer.SteeringValidationError) as err:
            st.register_vector("one-too-many", vec(80))
        assert str(err.value).startswith("name: cannot register 'one-too-many'"), err.value
        assert "max_named_vectors = 4" in str(err.value)
        assert (sorted(st.named_vectors), [sorted(d["named_vectors"]) for d in st.describe()]) == before
        st.register_vector(names[0], vec(81))  # replacing stays possible at the limit
        assert np.array_equal(st.named_vectors[names[0]], vec(81))
        # the workers refuse on their own too (every rank alike), e.g. for a call that bypasses the frontend
        with pytest.raises(Exception, match="max_named_vectors"):
            llm.collective_rpc("dynsteer_register_vector", args=("bypass", dynsteer.vectors.pack_vector(vec(82))))
        assert [sorted(d["named_vectors"]) for d in st.describe()] == before[1]
    finally:
        for name in names:
            llm.collective_rpc("dynsteer_unregister_vector", args=(name,))
            st._front.named.pop(name, None)
        st._front.version += 1
    assert_serving(llm, baseline)


def test_more_configurations_than_rows_wait_for_rows_and_none_runs_unsteered(engine):
    """max_rows=4 leaves 3 rows; 6 distinct configurations in one batch: the scheduler holds the ones that do not
    fit until rows free up, and every request is steered exactly as when it runs alone."""
    llm, st, baseline = engine
    specs = [SteeringSpec(vectors=[AddVector(layer=1, vector=vec(20 + i))]) for i in range(6)]
    alone = [token_ids(st.generate(PROMPTS[i % 4], greedy(), steering=s))[0] for i, s in enumerate(specs)]
    sched = scheduler_of(llm)
    waits = sched._dynsteer.waits if sched is not None else 0
    rejected, outputs = run_batch(llm, [encode_payload(s) for s in specs] + [None, None])
    assert not rejected and len(outputs) == 8
    assert [list(outputs[i].outputs[0].token_ids) for i in range(6)] == alone
    assert [list(outputs[i].outputs[0].token_ids) for i in (6, 7)] == [baseline[2], baseline[3]]
    assert all(outputs[i].outputs[0].finish_reason == "length" for i in range(8))
    if sched is not None:
        assert sched._dynsteer.waits > waits  # some requests did wait for rows
        assert not sched._dynsteer.live
    assert_serving(llm, baseline)  # the workers release the last rows when they learn of the finish (next step)
    assert st.describe()[0]["rows_in_use"] == 0


# ---- failures at run time stop the request alone -----------------------------------------------------------------------
def test_a_failing_custom_controller_stops_only_its_request(engine):
    llm, st, baseline = engine
    nan = pack_raw({"policy": policy_body(kind="custom", name="nan_after", options={"steps": 2})})
    unbuildable = pack_raw({"policy": policy_body(kind="custom", name="nan_after", options={"no_such": 1})})
    sched = scheduler_of(llm)
    before = sched._dynsteer.stopped_total if sched is not None else 0
    rejected, outputs = run_batch(llm, [None, nan, None, unbuildable])
    assert not rejected
    for i, message in ((1, "dynsteer: policy.controller: controller 'nan_after' returned scale nan"),
                       (3, "dynsteer: extra_args.dynsteer.policy.controller.options: controller 'nan_after' could "
                           "not be built")):
        out = outputs[i].outputs[0]
        assert out.finish_reason == "abort", out
        assert out.stop_reason.startswith(message), out.stop_reason
    assert len(outputs[1].outputs[0].token_ids) < 12 and len(outputs[3].outputs[0].token_ids) == 0
    assert [list(outputs[i].outputs[0].token_ids) for i in (0, 2)] == [baseline[0], baseline[2]]
    if sched is not None:
        assert sched._dynsteer.stopped_total == before + 2 and not sched._dynsteer.stopped
    assert_serving(llm, baseline)


# ---- the same over HTTP -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_path, files, tmp_path_factory):
    root, probe = files
    root = tmp_path_factory.mktemp("http")
    cfg = {"dynsteer": engine_config(root, probe).model_dump(mode="json")}
    with openai_server(tiny_llama_path, root / "server.log", ["--additional-config", json.dumps(cfg)]) as url:
        yield url, str(tiny_llama_path), root


def complete(server, payload=None, prompt: str = PROMPTS[0]) -> tuple[int, dict]:
    url, model, _ = server
    body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0}
    if payload is not None:
        body["vllm_xargs"] = {"dynsteer": payload}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode()}


def text(reply: tuple[int, dict]) -> tuple[int, str]:
    status, body = reply
    return status, body["choices"][0]["text"] if status == 200 else body["error"]


def test_http_attacks_get_400s_naming_the_field_and_the_server_keeps_serving(server, files, tmp_path):
    _, _, root = server
    status, base = complete(server)
    assert status == 200
    marker = tmp_path / "pwned"
    spec_big = {"spec": SteeringSpec(vectors=[AddVector(layer=1, vector=vec(0), scale=1e38)]).model_dump(mode="json")}
    probe_file = policy_body()
    probe_file["monitors"] = [{"name": "m", "layer": MON_LAYER, "probe_file": str(files[1])}]
    cases = [
        (pack_raw({"policy": policy_body(kind="custom", factory="subprocess:getoutput",
                                         options={"cmd": f"touch {marker}"})}),
         "extra_args.dynsteer.policy.controller: factory: import paths are not accepted"),
        (pack_raw({"policy": probe_file}), "extra_args.dynsteer.policy.monitors[0].probe_file: file paths"),
        (with_tag(encode_payload(SteeringSpec(), capture=CaptureSpec(layers=(MON_LAYER,), consumers=("filesystem",))),
                  "../../x"), "extra_args.dynsteer.tag: tag '../../x' is not a valid name"),
        (pack_raw({"policy": policy_body(kind="latch", on=0.0, off=0.0, scale=1e38)}),
         "extra_args.dynsteer.policy.controller.scale"),
        (pack_raw(spec_big), "extra_args.dynsteer.spec.vectors[0].scale"),
        ("ds1:" + "A" * (LIMITS.max_payload_bytes + 1), "max_payload_bytes"),
        (pack_raw({"spec": {"vectors": [{"layer": "1", "vector": "v"}]}}), "extra_args.dynsteer.spec.vectors[0].layer"),
    ]
    cases.append((deep_msgpack(), "extra_args.dynsteer"))
    for payload, message in cases:
        status, body = complete(server, payload)
        assert status == 400 and message in body["error"], (status, body)
        assert text(complete(server)) == text((200, base))
    assert not marker.exists() and not (root.parent / "x.json").exists()


def test_http_runtime_stop_and_row_exhaustion(server):
    status, base = complete(server)
    nan = pack_raw({"policy": policy_body(kind="custom", name="nan_after", options={"steps": 2})})
    status, body = complete(server, nan)
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "abort", body
    assert choice["stop_reason"].startswith("dynsteer: policy.controller: controller 'nan_after' returned scale nan")
    # six distinct configurations at once on three free rows: all answered, each as when alone
    payloads = [encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=vec(40 + i))])) for i in range(6)]
    alone = [complete(server, p) for p in payloads]
    results: dict[int, tuple[int, dict]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(server, payloads[i])))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [results[i][0] for i in range(6)] == [200] * 6
    assert [results[i][1]["choices"][0]["text"] for i in range(6)] == [a[1]["choices"][0]["text"] for a in alone]
    assert any(a[1]["choices"][0]["text"] != base["choices"][0]["text"] for a in alone)
    assert text(complete(server)) == text((200, base))
