"""The command desk without an engine: who may send what (CURVE identity, grants) and what one message and one step
may cost (MAXMSGSIZE, shape limits, the per-step byte budget and the message it holds over), against a stand-in
scheduler. Where a test needs several messages in one step, they are read off the real socket (CURVE identity
included) before the step, so the step sees exactly those."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import msgspec
import numpy as np
import pytest
import zmq

import dynsteer.engine.command_desk as desk_module
from dynsteer.commands import (COMMAND_ENVELOPE_BYTES, AbortCommand, CommandEnvelope, GlobalCommand, SteerCommand,
                               encode_command)
from dynsteer.config import DynsteerConfig, Limits, MonitorConfig
from dynsteer.engine.frontend import FrontendState
from dynsteer.engine.command_desk import CommandDesk
from dynsteer.engine.scheduler import SchedulerState
from dynsteer.monitor.client import CommandClient
from dynsteer.spec import AddVector, ModelShape, SteeringSpec, SteeringValidationError
from dynsteer.transport.security import CurveKeys, connect_curve

H = 256
SHAPE = ModelShape(num_layers=4, hidden_size=H, max_gates=2)
ALL_OPS = ("abort", "steer", "threshold", "rule", "global")
SERVER, ALPHA, BETA, GAMMA, STRANGER = (zmq.curve_keypair() for _ in range(5))


def _curve() -> CurveKeys:
    """ALPHA may use only 'alpha', GAMMA only 'gamma'; BETA (listed, unbound) any other name; STRANGER is not let in."""
    return CurveKeys(server_secret=SERVER[1].decode(), server_public=SERVER[0].decode(),
                     client_public_keys=(ALPHA[0].decode(), BETA[0].decode(), GAMMA[0].decode()),
                     client_names={ALPHA[0].decode(): ("alpha",), GAMMA[0].decode(): ("gamma",)})


@dataclass
class _Request:
    """What the desk reads and writes of a vLLM request."""

    request_id: str
    sampling_params: Any = None
    num_computed_tokens: int = 12
    num_prompt_tokens: int = 8
    cache_salt: str | None = None
    block_hashes: list = field(default_factory=list)

    def is_finished(self) -> bool:
        return False

    def update_block_hashes(self) -> None:
        pass


class _Scheduler:
    def __init__(self, *ids: str) -> None:
        self.requests = {r: _Request(r) for r in ids}
        self._dynsteer = SchedulerState(capacity=15)


@pytest.fixture
def make_desk(monkeypatch) -> Iterator[Any]:
    """``make_desk(curve=False, limits=Limits(), **monitor_config)``: a desk as the scheduler builds it, on a
    stand-in model (hidden size ``H``, named vector ``v``), closed after the test."""
    desks: list[CommandDesk] = []

    def make(curve: bool = False, limits: Limits = Limits(), **monitor: Any) -> CommandDesk:
        if curve:
            mon = MonitorConfig(endpoint="tcp://127.0.0.1:0", command_endpoint="tcp://127.0.0.1:0", curve=_curve(),
                                **monitor)
        else:
            mon = MonitorConfig.private(**monitor)
        state = FrontendState(SHAPE, {"v": np.full(H, 1e-3, np.float32)}, limits=limits)
        monkeypatch.setattr(desk_module, "build_frontend_state", lambda vllm_config: state)
        desks.append(CommandDesk(DynsteerConfig(monitor=mon, limits=limits), None))
        return desks[-1]

    yield make
    for desk in desks:
        desk.close()


def _client(desk: CommandDesk, key: tuple[bytes, bytes] | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if key is not None:
        connect_curve(sock, SERVER[0].decode(), key[1].decode(), key[0].decode())
    sock.connect(desk._binding.endpoint)
    return sock


def _msg(monitor: str, command: Any, cid: str = "c") -> bytes:
    return encode_command(CommandEnvelope(id=cid, monitor=monitor, command=command))


def _raw(monitor: str, command: dict[str, Any], cid: str = "c") -> bytes:
    return msgspec.msgpack.encode({"id": cid, "monitor": monitor, "command": command})


class _Queued:
    """The desk's socket with ``n`` messages already read off it: the desk's next steps take exactly those."""

    def __init__(self, sock: zmq.Socket, n: int, timeout_s: float = 20.0) -> None:
        self.sock, self.pending = sock, []
        deadline = time.monotonic() + timeout_s
        while len(self.pending) < n:
            assert time.monotonic() < deadline, f"only {len(self.pending)} of {n} messages arrived"
            if sock.poll(50):
                self.pending.append(sock.recv_multipart(copy=False))

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[Any]:
        if not self.pending:
            raise zmq.Again()
        return self.pending.pop(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def _queue(desk: CommandDesk, n: int) -> _Queued:
    desk.sock = _Queued(desk.sock.sock if isinstance(desk.sock, _Queued) else desk.sock, n)
    return desk.sock


def _acks(sock: zmq.Socket, n: int, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    out = []
    while len(out) < n:
        assert sock.poll(int(timeout_s * 1000)), f"only {len(out)} of {n} acks arrived"
        out.append(msgspec.msgpack.decode(sock.recv()))
    return out


def _names(sched: _Scheduler) -> set[str]:
    return set(sched._dynsteer.aborts)


# ---- identity ------------------------------------------------------------------------------------------------------
def test_a_curve_key_uses_only_the_names_bound_to_it(make_desk):
    desk = make_desk(curve=True)
    sched = _Scheduler(*(f"r{i}" for i in range(5)))
    alpha, beta, gamma = _client(desk, ALPHA), _client(desk, BETA), _client(desk, GAMMA)
    alpha.send(_msg("alpha", AbortCommand(request="r0"), "a-own"))
    alpha.send(_msg("beta-name", AbortCommand(request="r1"), "a-other"))
    beta.send(_msg("gamma", AbortCommand(request="r2"), "b-taken"))
    beta.send(_msg("free", AbortCommand(request="r3"), "b-free"))
    gamma.send(_msg("gamma", AbortCommand(request="r4"), "g-own"))
    _queue(desk, 5)
    desk.take(sched, 1)
    acks = {a["id"]: a for sock in (alpha, beta) for a in _acks(sock, 2)} | {a["id"]: a for a in _acks(gamma, 1)}
    assert {i for i, a in acks.items() if a["status"] == "applied"} == {"a-own", "b-free", "g-own"}
    assert acks["a-other"]["error"].startswith("monitor: 'beta-name' is not this connection's to use (this client "
                                               "key may use only 'alpha'"), acks["a-other"]
    assert acks["b-taken"]["error"].startswith("monitor: 'gamma' is not this connection's to use (the name is bound "
                                               "to another client key"), acks["b-taken"]
    assert _names(sched) == {"r0", "r3", "r4"}
    for sock in (alpha, beta, gamma):
        sock.close(0)


def test_a_key_outside_the_allowlist_is_never_read_and_the_client_says_why(make_desk):
    desk = make_desk(curve=True, grants={"*": ALL_OPS})
    sched = _Scheduler("r0")
    client = CommandClient(desk._binding.endpoint, "alpha", curve_server_public=SERVER[0].decode(),
                           curve_client_secret=STRANGER[1].decode(), curve_client_public=STRANGER[0].decode())
    cid = client.send(AbortCommand(request="r0"))
    with pytest.raises(PermissionError, match="refused this client's CURVE key"):
        client.wait(cid, timeout_s=20)
    assert client.refused
    for step in range(1, 4):
        desk.take(sched, step)
    assert desk.stats.received == 0 and not _names(sched)
    client.close()


def test_a_listed_key_commands_end_to_end_over_tcp_with_curve(make_desk):
    desk = make_desk(curve=True)
    sched = _Scheduler("r0")
    client = CommandClient(desk._binding.endpoint, "alpha", curve_server_public=SERVER[0].decode(),
                           curve_client_secret=ALPHA[1].decode(), curve_client_public=ALPHA[0].decode())
    cid = client.send(AbortCommand(request="r0", reason="probe"))
    for step in range(1, 2000):
        desk.take(sched, step)
        try:
            ack = client.wait(cid, timeout_s=0.01)
            break
        except TimeoutError:
            continue
    assert ack.status == "applied" and sched._dynsteer.aborts["r0"] == "dynsteer monitor alpha: probe"
    client.close()


def test_over_ipc_a_name_is_self_declared_and_grants_still_apply(make_desk):
    desk = make_desk(grants={"*": ("abort",), "ops": ALL_OPS})
    sched = _Scheduler("r0", "r1")
    sock = _client(desk)
    sock.send(_msg("alpha", AbortCommand(request="r0"), "1"))
    sock.send(_msg("anyone", GlobalCommand(spec=SteeringSpec(vectors=[AddVector(layer=1, vector="v")])), "2"))
    sock.send(_msg("ops", AbortCommand(request="r1"), "3"))
    _queue(desk, 3)
    desk.take(sched, 1)
    acks = {a["id"]: a for a in _acks(sock, 3)}
    assert acks["1"]["status"] == acks["3"]["status"] == "applied"
    assert acks["2"]["error"] == "command.op: monitor 'anyone' is not granted 'global' (MonitorConfig.grants)"
    sock.close(0)


# ---- grants --------------------------------------------------------------------------------------------------------
def test_global_is_granted_to_nobody_by_default_and_a_refused_one_changes_nothing(make_desk, monkeypatch):
    desk = make_desk()
    sched = _Scheduler("r0")
    compiled = []
    monkeypatch.setattr(desk.state, "check_global", lambda *a: compiled.append(a))
    sock = _client(desk)
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector="v")])
    sock.send(_msg("m", GlobalCommand(spec=spec), "g"))
    sock.send(_raw("m", {"op": "global", "spec": {"vectors": [{"layer": 99, "vector": "v"}]}}, "bad"))
    _queue(desk, 2)
    out = desk.take(sched, 1)
    acks = {a["id"]: a for a in _acks(sock, 2)}
    for cid in ("g", "bad"):  # refused on the op before the spec is even validated
        assert acks[cid] == {"id": cid, "status": "rejected", "step": None, "request": None,
                             "error": "command.op: monitor 'm' is not granted 'global' (MonitorConfig.grants)"}
    assert out == [] and not compiled
    assert desk.state.global_spec.is_empty() and sched._dynsteer.global_salt == ""
    sock.close(0)


def test_each_op_needs_its_grant_and_a_granted_global_applies(make_desk):
    desk = make_desk(grants={"*": ("abort",), "ops": ALL_OPS, "tuner": ("threshold", "rule")})
    sched = _Scheduler("r0", "r1")
    sock = _client(desk)
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector="v", tier="decode")])
    sock.send(_msg("m", SteerCommand(request="r0", spec=spec), "steer"))
    sock.send(_msg("tuner", AbortCommand(request="r0"), "abort"))
    sock.send(_msg("m", AbortCommand(request="r1"), "ok"))
    sock.send(_msg("ops", GlobalCommand(spec=spec), "global"))
    _queue(desk, 4)
    out = desk.take(sched, 1)
    acks = {a["id"]: a for a in _acks(sock, 4)}
    assert acks["steer"]["error"] == "command.op: monitor 'm' is not granted 'steer' (MonitorConfig.grants)"
    assert acks["abort"]["error"] == "command.op: monitor 'tuner' is not granted 'abort' (MonitorConfig.grants)"
    assert acks["ok"]["status"] == acks["global"]["status"] == "applied"
    assert _names(sched) == {"r1"}
    assert [w["command"]["op"] for w in out] == ["global"] and desk.state.global_spec == spec
    assert sched._dynsteer.global_salt != ""
    sock.close(0)


# ---- shape ---------------------------------------------------------------------------------------------------------
def test_shape_limits_refuse_a_large_steer_or_global_before_validation_or_compile(make_desk, monkeypatch):
    desk = make_desk(grants={"*": ALL_OPS})
    sched = _Scheduler("r0")
    compiled = []
    real_compile = desk_module.compile_phase
    monkeypatch.setattr(desk_module, "compile_phase", lambda *a, **k: compiled.append(a) or real_compile(*a, **k))
    monkeypatch.setattr(desk.state, "check_global", lambda *a: compiled.append(a))
    entry = {"layer": 1, "vector": "v", "tier": "decode"}
    deep: Any = {"layer": 1, "vector": "v"}
    for _ in range(40):
        deep = {"x": deep}
    sock = _client(desk)
    sock.send(_raw("m", {"op": "steer", "request": "r0", "spec": {"vectors": [entry] * 257}}, "steer"))
    sock.send(_raw("m", {"op": "global", "spec": {"vectors": [entry] * 5500}}, "global"))
    sock.send(_raw("m", {"op": "steer", "request": "r0", "spec": {"vectors": [deep]}}, "deep"))
    _queue(desk, 3)
    desk.take(sched, 1)
    acks = {a["id"]: a for a in _acks(sock, 3)}
    for cid in ("steer", "global"):
        assert acks[cid]["error"].startswith("command.spec: ") and "max_entries" in acks[cid]["error"], acks[cid]
    assert acks["deep"]["error"].startswith("command.spec: ") and "max_depth" in acks["deep"]["error"]
    assert not compiled
    sock.send(_raw("m", {"op": "steer", "request": "r0", "spec": {"vectors": [entry] * 8}}, "small"))
    _queue(desk, 1)
    desk.take(sched, 2)
    assert _acks(sock, 1)[0] == {"id": "small", "status": "applied", "step": 2, "error": None, "request": "r0"}
    assert len(compiled) == 1
    sock.close(0)


# ---- request ids -------------------------------------------------------------------------------------------------
def test_a_command_may_name_the_user_id_of_exactly_one_live_request(make_desk):
    """vLLM's engine ids are the user's plus ``-`` and 8 hex characters: a command naming the user id reaches that
    request (the ack names its engine id); one shared by two live requests (``n > 1`` samples) is refused."""
    desk = make_desk()
    sched = _Scheduler("32-bad6edaa", "3-0123abcd", "0_7-aaaaaaaa", "1_7-bbbbbbbb", "7-cccccccc")
    sock = _client(desk)
    sock.send(_msg("m", AbortCommand(request="32", reason="x"), "user"))
    sock.send(_msg("m", AbortCommand(request="3-0123abcd"), "engine"))
    sock.send(_msg("m", AbortCommand(request="0_7"), "child"))
    sock.send(_msg("m", AbortCommand(request="bad6edaa"), "none"))
    _queue(desk, 4)
    desk.take(sched, 5)
    acks = {a["id"]: a for a in _acks(sock, 4)}
    assert (acks["user"]["status"], acks["user"]["request"], acks["user"]["step"]) == ("applied", "32-bad6edaa", 5)
    assert acks["engine"]["request"] == "3-0123abcd" and acks["child"]["request"] == "0_7-aaaaaaaa"
    assert acks["none"]["error"] == "command.request: no live request 'bad6edaa'"
    assert set(sched._dynsteer.aborts) == {"32-bad6edaa", "3-0123abcd", "0_7-aaaaaaaa"}
    sched.requests["7-dddddddd"] = _Request("7-dddddddd")
    sock.send(_msg("m", AbortCommand(request="7"), "twice"))
    _queue(desk, 1)
    desk.take(sched, 6)
    error = _acks(sock, 1)[0]["error"]
    assert error.startswith("command.request: '7' is the user id of 2 live requests (7-cccccccc, 7-dddddddd)")
    assert "7-cccccccc" not in sched._dynsteer.aborts
    sock.close(0)


# ---- per-step budget -----------------------------------------------------------------------------------------------
def _steps_by_budget(sizes: list[int], budget: int, first_step: int = 1) -> list[int]:
    """The step each message is taken at under the byte budget (a step's first message always goes)."""
    steps, step, spent = [], first_step, 0
    for size in sizes:
        if spent and spent + size > budget:
            step, spent = step + 1, 0
        steps.append(step)
        spent += size
    return steps


def test_the_byte_budget_spreads_a_burst_over_consecutive_steps_holding_one_message(make_desk):
    budget = 4096
    desk = make_desk(max_command_bytes_per_step=budget)
    ids = [f"r{i}-" + "x" * 250 for i in range(12)]
    sched = _Scheduler(*ids)
    sock = _client(desk)
    raws = [_msg("m", AbortCommand(request=r, reason="y" * 500), f"c{i}") for i, r in enumerate(ids)]
    for raw in raws:
        sock.send(raw)
    queued = _queue(desk, len(raws))
    want = _steps_by_budget([len(r) for r in raws], budget)
    assert want[0] == 1 and want[-1] >= 3, want  # the burst does not fit one step
    desk.take(sched, 1)
    assert desk.stats.received == want.count(1)  # the one held over is read, not taken
    assert len(queued.pending) == len(raws) - want.count(1) - 1  # nothing more read once one is held
    for step in range(2, want[-1] + 1):
        desk.take(sched, step)
    acks = _acks(sock, len(raws))
    assert [a["id"] for a in acks] == [f"c{i}" for i in range(len(raws))]
    assert [a["step"] for a in acks] == want and all(a["status"] == "applied" for a in acks)
    assert desk.stats.carried == want[-1] - 1
    sock.close(0)


def _inline_global(n: int) -> GlobalCommand:
    rng = np.random.default_rng(0)
    return GlobalCommand(spec=SteeringSpec(vectors=[AddVector(layer=1, vector=rng.standard_normal(H).astype(
        np.float32) * 1e-3) for _ in range(n)]))


def test_an_oversize_first_message_is_taken_and_a_global_ends_its_step(make_desk):
    desk = make_desk(grants={"*": ALL_OPS}, max_command_bytes_per_step=4096)
    sched = _Scheduler("r0", "r1")
    sock = _client(desk)
    big = _msg("m", _inline_global(5), "big")
    assert len(big) > 4096
    sock.send(big)
    sock.send(_msg("m", AbortCommand(request="r0"), "a0"))
    sock.send(_msg("m", _inline_global(1), "small-global"))
    sock.send(_msg("m", AbortCommand(request="r1"), "a1"))
    _queue(desk, 4)
    for step in (1, 2, 3):
        desk.take(sched, step)
    assert [(a["id"], a["step"]) for a in _acks(sock, 4)] == [("big", 1), ("a0", 2), ("small-global", 2), ("a1", 3)]
    sock.close(0)


def test_a_steer_is_charged_what_its_compile_costs(make_desk):
    budget = 64 << 10
    desk = make_desk(max_command_bytes_per_step=budget)
    sched = _Scheduler("r0", "r1")
    sock = _client(desk)
    entry = {"layer": 1, "vector": "v", "tier": "decode"}
    for cid, n in (("wide", 100), ("narrow", 2)):  # 100 named vectors compile 100 * 4 * H bytes > budget
        raw = _raw("m", {"op": "steer", "request": "r0", "spec": {"vectors": [entry] * n}}, cid)
        assert len(raw) < budget // 8
        sock.send(raw)
        sock.send(_msg("m", AbortCommand(request="r1"), f"after-{cid}"))
    _queue(desk, 4)
    for step in (1, 2):
        desk.take(sched, step)
    assert [(a["id"], a["step"]) for a in _acks(sock, 4)] == [("wide", 1), ("after-wide", 2), ("narrow", 2),
                                                               ("after-narrow", 2)]
    sock.close(0)


# ---- message size --------------------------------------------------------------------------------------------------
def test_an_oversized_message_drops_only_its_connection_unread(make_desk):
    limits = Limits(max_payload_bytes=1024)
    desk = make_desk(limits=limits)
    sched = _Scheduler("r0")
    flood, other = _client(desk), _client(desk)
    flood.send(_raw("m", {"op": "abort", "request": "r0", "reason": "z" * (256 << 10)}, "huge"))
    time.sleep(0.2)  # sent first (a second connection's message may still overtake it: both are checked below)
    other.send(_msg("other", AbortCommand(request="r0"), "small"))
    deadline = time.monotonic() + 20
    step = 0
    while not other.poll(0) and time.monotonic() < deadline:
        step += 1
        desk.take(sched, step)
        time.sleep(0.005)
    assert _acks(other, 1)[0]["status"] == "applied"
    for _ in range(50):  # a while longer: the oversized message is never read, so never answered
        step += 1
        desk.take(sched, step)
        time.sleep(0.01)
    assert not flood.poll(0) and desk.stats.received == 1
    assert desk.sock.getsockopt(zmq.MAXMSGSIZE) == 1024 + COMMAND_ENVELOPE_BYTES
    flood.close(0)
    other.close(0)


def test_the_client_refuses_a_command_the_engine_would_not_take():
    client = CommandClient("ipc:///nonexistent/commands", "m", limits=Limits(max_payload_bytes=1024))
    with pytest.raises(SteeringValidationError, match=r"^message: \d+ bytes exceeds the engine's limit of 5120"):
        client.send(_inline_global(8))
    client.close()
