"""Property-based fuzzing of what monitor peers send (hypothesis): stream control messages and commands.

* Stream hub (no engine, 3,000 messages): fuzzed client messages (mutated hellos, acks, pings, byes and stats
  requests, arbitrary msgpack and bytes) from fresh connections, some claiming the name of a live subscriber, while
  the hub publishes. Every reply is a welcome, stats, or an error naming its field; the live subscriber receives
  every published message, exact and in order; the accounting identity holds throughout.
* Command desk (a real CPU engine, 3,000 commands): fuzzed command messages (mutated valid commands of every op,
  arbitrary msgpack and bytes) sent while a batch generates. Every message gets exactly one ack, ``applied`` or
  rejected with the field named first (never an internal error); a request no command names keeps its exact tokens.
"""

from __future__ import annotations

import copy
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

NASTY = [math.nan, math.inf, -math.inf, 1e38, -1e300, 0, -1, 2 ** 31, 2 ** 63 - 1, "", "1", True, None, [], {},
         "../x", "a" * 300, "block", "spill", "drop", "s", "good", "global", "abort", [1.0] * 9, list(range(300)),
         {"b64": "AAAA"}, {"op": "hello"}]
scalars = st.one_of(st.sampled_from(NASTY), st.floats(allow_nan=True, allow_infinity=True), st.integers(-2 ** 63, 2 ** 64 - 1),
                    st.text(max_size=10), st.booleans(), st.none())
trees = st.recursive(scalars, lambda ch: st.one_of(st.lists(ch, max_size=4),
                                                   st.dictionaries(st.text(max_size=8), ch, max_size=4)), max_leaves=16)


def _paths(node: Any, path: tuple = ()) -> Iterator[tuple]:
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


def mutated(templates: list[dict[str, Any]], keys: list[str]) -> st.SearchStrategy[Any]:
    """A template with up to three mutations (a value replaced, a key removed or added), or anything at all."""

    @st.composite
    def build(draw: Any) -> Any:
        if draw(st.integers(0, 9)) == 0:
            return copy.deepcopy(draw(trees))
        body = copy.deepcopy(draw(st.sampled_from(templates)))
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
                parent[draw(st.sampled_from(keys))] = copy.deepcopy(draw(trees))
            else:
                parent[path[-1]] = copy.deepcopy(draw(trees))
        return body

    return build()


def _frame(body: Any, raw: bytes | None) -> bytes | None:
    if raw is not None:
        return raw
    try:
        return msgspec.msgpack.encode(body)
    except (TypeError, OverflowError, ValueError):
        return None  # not representable in msgpack: no client can send it


# ---- the stream hub --------------------------------------------------------------------------------------------------
HELLO = {"op": "hello", "v": 1, "name": "fz", "streams": ["s"], "policy": "drop", "max_pending": 8,
         "max_delay_ms": 5.0, "window": 4}
CLIENT_TEMPLATES = [HELLO, {**HELLO, "name": "good"}, {**HELLO, "policy": "block", "max_delay_ms": 60_000.0},
                    {**HELLO, "declare": {"x": {"places": ["1.post_block"]}}, "streams": ["x"]},
                    {**HELLO, "resume": {"s": 0}}, {"op": "ack", "stream": "s", "seq": 3}, {"op": "ping"},
                    {"op": "bye"}, {"op": "stats"}]
CLIENT_KEYS = ["op", "v", "name", "streams", "policy", "max_pending", "max_delay_ms", "window", "resume", "declare",
               "stream", "seq"]
# the operation's fields, or (an unknown key) the key itself, as the hub names it
CLIENT_FIELD = re.compile(r"^(message|op|hello|ack|ping|bye|stats)([.\[][^\s:]*)?$")
HUB_COUNT = {"messages": 0, "errors": 0, "welcomes": 0}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: Any) -> Iterator[Any]:
    import tempfile

    from dynsteer.monitor.subscriber import StreamSubscriber
    from dynsteer.streams.hub import StreamHub

    folder = Path(tempfile.mkdtemp(prefix="dfz-"))  # short: a Unix socket path has 108 bytes
    h = StreamHub(f"ipc://{folder}/hub", heartbeat_s=0.2)
    h.declare("s", {"kind": "fuzz"})
    good = StreamSubscriber(h.endpoint, "good", ["s"], policy="drop", max_pending=1 << 16, heartbeat_s=0.1)
    yield h, good, {"next": 0}
    good.close()
    h.close()


# no shrinking: a batch that fails is reported whole (shrinking 50-message batches takes minutes)
@settings(max_examples=60, deadline=None, derandomize=True, database=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(mutated(CLIENT_TEMPLATES, CLIENT_KEYS),
                                st.one_of(st.none(), st.none(), st.binary(max_size=48))), min_size=50, max_size=50))
def test_stream_hub_answers_fuzzed_control_messages_and_keeps_serving(hub: Any, batch: list) -> None:
    h, good, state = hub
    ctx = zmq.Context.instance()
    socks = [ctx.socket(zmq.DEALER) for _ in range(3)]  # a few connections: names held by one, claimed by another
    try:
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(h.endpoint)
        sent = 0
        for i, (body, raw) in enumerate(batch):
            frame = _frame(body, raw)
            if frame is None:
                continue
            socks[i % len(socks)].send(frame)
            sent += 1
            if i % 10 == 0:  # the hub publishes meanwhile
                h.publish("s", {"step": state["next"], "req_ids": ["r"]}, [np.full(4, state["next"], np.float32)])
                state["next"] += 1
        HUB_COUNT["messages"] += sent
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            for s in socks:
                while s.poll(0):
                    parts = s.recv_multipart()
                    header = msgspec.msgpack.decode(parts[0])
                    assert isinstance(header, dict), header
                    if header.get("op") == "error":
                        HUB_COUNT["errors"] += 1
                        assert CLIENT_FIELD.match(str(header.get("field"))), header
                        assert str(header.get("message")), header
                    elif header.get("op") == "welcome":
                        HUB_COUNT["welcomes"] += 1
                    else:
                        assert header.get("op") in ("stats", "frame", "ping"), header  # ping: is a name's holder alive?
            time.sleep(0.01)
    finally:
        for s in socks:
            s.close(0)
    # the live subscriber got every message published so far, exactly once, in order, unaltered
    expected = state.setdefault("received", 0)
    while expected < state["next"]:
        frame = good.recv(timeout_s=10)
        assert frame is not None, f"message {expected} never reached the live subscriber"
        assert frame.seq == expected and frame.arrays[0].tolist() == [float(expected)] * 4, (frame.seq, expected)
        expected += 1
    state["received"] = expected
    stats = h.stats()
    for info in (v for k, v in stats.items() if not k.startswith("_")):
        for c in info["subscribers"].values():
            assert c["published"] == c["delivered"] + c["dropped"] + c["spilled"] + c["pending"], c


def test_the_hub_fuzzer_ran() -> None:
    if HUB_COUNT["messages"] < 2000:
        pytest.skip("run together with the stream hub fuzz test")
    assert HUB_COUNT["errors"] > 500 and HUB_COUNT["welcomes"] > 50, HUB_COUNT


# ---- the command desk ------------------------------------------------------------------------------------------------
ENGINE_H, MON_LAYER, ACT_LAYER, TOKENS = 128, 1, 2, 10
# a field path (an unknown key is named as itself), then the message
ACK_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*: \S")
CMD_COUNT = {"sent": 0, "applied": 0, "rejected": 0}


def _vec(seed: int, scale: float = 4.0) -> list[float]:
    return (np.random.default_rng(seed).standard_normal(ENGINE_H) * scale).astype(np.float32).tolist()


def _cmd_templates() -> list[dict[str, Any]]:
    spec = {"vectors": [{"layer": ACT_LAYER, "vector": {"b64": _b64(_vec(1))}, "scale": 1.5, "tier": "decode"}],
            "clamps": [{"layer": MON_LAYER, "direction": {"b64": _b64(_vec(2))}, "lo": -1.0, "hi": 1.0}]}
    policy = {"monitors": [{"name": "m", "layer": MON_LAYER, "direction": {"b64": _b64(_vec(3))}, "sharpness": 2.0,
                            "threshold": 0.0}],
              "rules": [{"monitor": "m", "actions": [{"kind": "add", "layer": ACT_LAYER,
                                                      "vector": {"b64": _b64(_vec(4))}}]}]}
    env = {"v": 1, "id": "c", "monitor": "fz"}
    return [{**env, "command": {"op": "abort", "request": "TARGET", "reason": "fuzz"}},
            {**env, "command": {"op": "steer", "request": "TARGET", "spec": spec}},
            {**env, "command": {"op": "steer", "request": "TARGET", "spec": None}},
            {**env, "command": {"op": "threshold", "request": "TARGET", "monitor": "m", "threshold": -5.0}},
            {**env, "command": {"op": "rule", "request": "TARGET", "rule": 0, "enabled": False}},
            {**env, "command": {"op": "global", "spec": spec, "policy": policy}},
            {**env, "command": {"op": "abort", "request": "nope"}}]


def _b64(values: list[float]) -> str:
    import base64

    return base64.b64encode(np.asarray(values, "<f4").tobytes()).decode()


CMD_KEYS = ["v", "id", "monitor", "command", "op", "request", "reason", "spec", "threshold", "rule", "enabled",
            "policy", "vectors", "layer", "vector", "scale", "tier", "monitors", "rules", "actions", "b64"]


@pytest.fixture(scope="module")
def desk_engine(tiny_llama_path: Any) -> Iterator[Any]:
    import dynsteer
    from dynsteer import Action, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule
    from dynsteer.config import MonitorConfig
    from tests.conftest import make_llm, token_ids
    from vllm import SamplingParams

    cfg = DynsteerConfig(max_gates=2, monitor=MonitorConfig.private())
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
        st_ = dynsteer.attach(llm)
        d = np.asarray(_vec(3), np.float32)
        policy = DynamicSteeringPolicy(
            monitors=[ProbeGate(name="m", layer=MON_LAYER, direction=d / np.linalg.norm(d), sharpness=2.0,
                              threshold=0.0)],
            rules=[Rule(monitor="m", actions=[Action(kind="add", layer=ACT_LAYER,
                                                     vector=np.asarray(_vec(4), np.float32))])])
        ref = token_ids(llm.generate(["a good request"], params))[0]
        yield llm, st_, cfg, params, policy, ref


def _with_target(body: Any, target: str) -> Any:
    if isinstance(body, dict):
        return {k: (target if v == "TARGET" else _with_target(v, target)) for k, v in body.items()}
    if isinstance(body, list):
        return [_with_target(v, target) for v in body]
    return body


@settings(max_examples=30, deadline=None, derandomize=True, database=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(mutated(_cmd_templates(), CMD_KEYS),
                                st.one_of(st.none(), st.none(), st.none(), st.binary(max_size=48))),
                      min_size=100, max_size=100))
def test_command_desk_acks_every_fuzzed_command_and_other_requests_stay_exact(desk_engine: Any, batch: list) -> None:
    llm, st_, cfg, params, policy, ref = desk_engine
    engine = llm.llm_engine
    plist, _ = st_._params(["the target", "a good request"], params, None, policy=[policy, None])
    stamp = time.monotonic_ns()
    engine.add_request(f"target-{stamp}", "the target", plist[0])
    engine.add_request(f"good-{stamp}", "a good request", plist[1])
    sched = engine.engine_core.engine_core.scheduler
    target = next(r for r in sched.requests if r.startswith(f"target-{stamp}"))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cfg.monitor.command_endpoint)
    outputs, sent, acks, steps = {}, 0, [], 0
    try:
        deadline = time.monotonic() + 120
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "engine hung"
            if steps == 2:
                for body, raw in batch:
                    frame = _frame(_with_target(body, target), raw)
                    if frame is not None:
                        sock.send(frame)
                        sent += 1
                time.sleep(0.2)  # delivered before the next step drains the socket
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id.split("-")[0]] = list(out.outputs[0].token_ids)
            while sock.poll(0):
                acks.append(msgspec.msgpack.decode(sock.recv()))
            steps += 1
        while len(acks) < sent and sock.poll(2000):  # the engine is idle: acks of the last step's intake
            acks.append(msgspec.msgpack.decode(sock.recv()))
        deadline = time.monotonic() + 60  # its own wait: a loaded machine may have spent the first on the steps
        spare = 0
        while len(acks) < sent and time.monotonic() < deadline:  # commands taken at later steps
            if not engine.has_unfinished_requests():  # vLLM's step schedules nothing (and takes no command) idle
                engine.add_request(f"spare-{stamp}-{spare}", "a spare request", params)
                spare += 1
            engine.step()
            while sock.poll(50):
                acks.append(msgspec.msgpack.decode(sock.recv()))
    finally:
        sock.close(0)
    assert len(acks) == sent, (len(acks), sent)
    for ack in acks:
        assert ack["status"] in ("applied", "rejected"), ack
        if ack["status"] == "rejected":
            assert ACK_FIELD.match(ack["error"] or ""), ack
            assert "internal error" not in ack["error"], ack
    CMD_COUNT["sent"] += sent
    CMD_COUNT["applied"] += sum(a["status"] == "applied" for a in acks)
    CMD_COUNT["rejected"] += sum(a["status"] == "rejected" for a in acks)
    assert outputs["good"] == ref


def test_the_command_fuzzer_ran() -> None:
    if CMD_COUNT["sent"] < 2500:
        pytest.skip("run together with the command fuzz test")
    assert CMD_COUNT["applied"] > 50 and CMD_COUNT["rejected"] > 1500, CMD_COUNT
