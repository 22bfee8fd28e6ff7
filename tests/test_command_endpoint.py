"""The command endpoint of a real CPU engine over loopback tcp with CURVE: monitors are peers, not the operator.

One engine; its monitors: ``ops`` (its key may use only that name; granted every op, ``global`` included) and
``tox`` (its key bound to that name; granted ``steer``, ``threshold`` and ``rule`` only), and a stranger whose key
is not on the allowlist. The engine is stepped by hand; commands are sent a few steps into a run and reach the
engine before its next step. Every refused command leaves every request's tokens equal to the unmonitored run.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from typing import Any, Callable

import msgspec
import numpy as np
import pytest
import zmq

import dynsteer
from dynsteer.commands import AbortCommand, CommandEnvelope, GlobalCommand, SteerCommand, encode_command
from dynsteer.config import DynsteerConfig, Limits, MonitorConfig
from dynsteer.monitor.client import CommandClient
from dynsteer.spec import AddVector, SteeringSpec
from dynsteer.transport.security import CurveKeys, connect_curve
from tests.conftest import make_llm

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning"]
MAX_TOKENS = 24
H = 128  # the tiny llama's hidden size
BUDGET = 4096  # bytes of commands per step (the least MonitorConfig allows)
SERVER, OPS, TOX, STRANGER = (zmq.curve_keypair() for _ in range(4))
PUSH = SteeringSpec(vectors=[AddVector(layer=1, vector=np.random.default_rng(2).standard_normal(H).astype(
    np.float32) * 8)])  # changes every request's tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    ops, tox = OPS[0].decode(), TOX[0].decode()
    curve = CurveKeys(server_secret=SERVER[1].decode(), server_public=SERVER[0].decode(),
                      client_public_keys=(ops, tox), client_names={ops: ("ops",), tox: ("tox",)})
    mon = MonitorConfig(endpoint=f"tcp://127.0.0.1:{_free_port()}",
                        command_endpoint=f"tcp://127.0.0.1:{_free_port()}", curve=curve,
                        grants={"ops": ("abort", "steer", "threshold", "rule", "global"),
                                "tox": ("steer", "threshold", "rule")},
                        max_command_bytes_per_step=BUDGET)
    cfg = DynsteerConfig(monitor=mon, limits=Limits(max_payload_bytes=64 << 10))
    with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        st.register_vector("v", np.full(H, 1e-3, np.float32))
        yield llm, cfg, st


@pytest.fixture(autouse=True)
def _no_global_left(engine):
    yield
    engine[2].clear_all()  # a test that failed with a global applied leaves none to the next


def _client(engine, key: tuple[bytes, bytes], name: str) -> CommandClient:
    return CommandClient(engine[1].monitor.command_endpoint, name, curve_server_public=SERVER[0].decode(),
                         curve_client_secret=key[1].decode(), curve_client_public=key[0].decode())


def _generate(engine, send: Callable[[list[str]], Any] | None = None, at_step: int = 3,
              later: Callable[[list[str]], Any] | None = None) -> list[list[int]]:
    """Greedy tokens of ``PROMPTS``, stepping the engine by hand; after ``at_step`` steps ``send(request ids)``
    sends commands, which reach the engine before the next step (``later``: the same, 10 steps on)."""
    from vllm import SamplingParams

    eng = engine[0].llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tag = uuid.uuid4().hex[:8]
    names = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    ids = [eng.add_request(n, p, params) for n, p in zip(names, PROMPTS)]
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        for when, fn in ((at_step, send), (at_step + 10, later)):
            if steps == when and fn is not None:
                fn(ids)
                time.sleep(0.5)  # on their way over loopback: queued before the next step takes commands
    return [done[n] for n in names]


@pytest.fixture(scope="module")
def baseline(engine) -> list[list[int]]:
    return _generate(engine)


def _sent(client: CommandClient, command: Any, into: list[str]) -> None:
    into.append(client.send(command))


def _desk(engine) -> Any:
    core = getattr(engine[0].llm_engine.engine_core, "engine_core", None)  # in-process engine core only
    return None if core is None else core.scheduler._dynsteer.desk


@pytest.mark.timeout(300)
def test_a_key_outside_the_allowlist_gets_nothing_applied(engine, baseline):
    stranger = _client(engine, STRANGER, "ops")
    cids: list[str] = []

    def send(ids: list[str]) -> None:
        for command in (GlobalCommand(spec=PUSH), AbortCommand(request=ids[0])):
            with contextlib.suppress(PermissionError):  # refused at the handshake: the client knows at once
                cids.append(stranger.send(command, timeout_s=10))

    got = _generate(engine, send)
    assert got == baseline
    with pytest.raises(PermissionError, match="refused this client's CURVE key"):
        stranger.wait(cids[0] if cids else "-", timeout_s=10)
    stranger.close()


def test_a_monitor_without_the_global_grant_is_rejected_and_nothing_changes(engine, baseline):
    tox = _client(engine, TOX, "tox")
    cids: list[str] = []
    got = _generate(engine, lambda ids: _sent(tox, GlobalCommand(spec=PUSH), cids))
    ack = tox.wait(cids[0], timeout_s=30)
    tox.close()
    assert ack.status == "rejected"
    assert ack.error == "command.op: monitor 'tox' is not granted 'global' (MonitorConfig.grants)"
    assert got == baseline


def test_a_monitor_without_the_abort_grant_cannot_abort_a_request(engine, baseline):
    tox = _client(engine, TOX, "tox")
    cids: list[str] = []
    got = _generate(engine, lambda ids: _sent(tox, AbortCommand(request=ids[0], reason="not yours"), cids))
    ack = tox.wait(cids[0], timeout_s=30)
    tox.close()
    assert ack.error == "command.op: monitor 'tox' is not granted 'abort' (MonitorConfig.grants)"
    assert got == baseline


def test_a_granted_monitor_applies_a_global_and_clears_it(engine, baseline):
    ops = _client(engine, OPS, "ops")
    cids: list[str] = []
    got = _generate(engine, lambda ids: _sent(ops, GlobalCommand(spec=PUSH), cids),
                    later=lambda ids: _sent(ops, GlobalCommand(), cids))
    applied, cleared = (ops.wait(c, timeout_s=30) for c in cids)
    ops.close()
    assert applied.status == cleared.status == "applied", (applied, cleared)
    assert all(g != b for g, b in zip(got, baseline))  # every request, from the acked step on
    assert _generate(engine) == baseline


def test_a_name_bound_to_another_key_is_rejected(engine, baseline):
    impostor = _client(engine, TOX, "ops")  # tox's key, claiming the granted name
    cids: list[str] = []
    got = _generate(engine, lambda ids: _sent(impostor, GlobalCommand(spec=PUSH), cids))
    ack = impostor.wait(cids[0], timeout_s=30)
    impostor.close()
    assert ack.status == "rejected"
    assert ack.error.startswith("monitor: 'ops' is not this connection's to use (this client key may use only "
                                "'tox'"), ack.error
    assert got == baseline


def test_a_257_entry_steer_is_rejected_naming_the_field(engine, baseline):
    tox = _client(engine, TOX, "tox")
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector="v", tier="decode")] * 257)
    cids: list[str] = []
    got = _generate(engine, lambda ids: _sent(tox, SteerCommand(request=ids[0], spec=spec), cids))
    ack = tox.wait(cids[0], timeout_s=30)
    tox.close()
    assert ack.status == "rejected"
    assert ack.error.startswith("command.spec: ") and "max_entries = 256" in ack.error, ack.error
    assert got == baseline


def test_a_large_global_is_rejected_by_shape_before_compile(engine, baseline, monkeypatch):
    desk = _desk(engine)
    compiled: list[Any] = []
    if desk is not None:
        check = desk.state.check_global
        monkeypatch.setattr(desk.state, "check_global", lambda *a: compiled.append(a) or check(*a))
    ops = _client(engine, OPS, "ops")
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector="v", scale=0.0)] * 600)
    cids: list[str] = []
    got = _generate(engine, lambda ids: _sent(ops, GlobalCommand(spec=spec), cids))
    ack = ops.wait(cids[0], timeout_s=30)
    ops.close()
    assert ack.status == "rejected"
    assert ack.error.startswith("command.spec: ") and "max_entries = 256" in ack.error, ack.error
    assert not compiled
    assert got == baseline


def test_two_commands_over_the_byte_budget_in_one_step_are_acked_at_consecutive_steps(engine, baseline):
    tox = _client(engine, TOX, "tox")
    rng = np.random.default_rng(5)

    def steer(request: str) -> SteerCommand:
        return SteerCommand(request=request, spec=SteeringSpec(vectors=[
            AddVector(layer=1, vector=rng.standard_normal(H).astype(np.float32) * 1e-3, tier="decode")
            for _ in range(3)]))

    size = len(encode_command(CommandEnvelope(id="x" * 12, monitor="tox", command=steer("x" * 20))))
    assert BUDGET // 2 < size <= BUDGET  # two do not fit one step's budget, one does
    cids: list[str] = []
    _generate(engine, lambda ids: [cids.append(tox.send(steer(request))) for request in ids[:2]])
    first, second = (tox.wait(c, timeout_s=30) for c in cids)
    tox.close()
    assert first.status == second.status == "applied", (first, second)
    assert second.step == first.step + 1


def test_an_oversized_message_is_dropped_unanswered_and_other_monitors_are_served(engine, baseline):
    flood = zmq.Context.instance().socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    connect_curve(flood, SERVER[0].decode(), OPS[1].decode(), OPS[0].decode())
    flood.connect(engine[1].monitor.command_endpoint)
    tox = _client(engine, TOX, "tox")
    huge = msgspec.msgpack.encode({"id": "huge", "monitor": "ops", "command": {
        "op": "abort", "request": "r", "reason": "z" * (256 << 10)}})  # over MAXMSGSIZE (64 KiB + 4 KiB)
    cids: list[str] = []

    def send(ids: list[str]) -> None:
        flood.send(huge)
        cids.append(tox.send(SteerCommand(request=ids[0], spec=None)))

    got = _generate(engine, send)
    assert tox.wait(cids[0], timeout_s=30).status == "applied"
    assert _generate(engine) == baseline  # more steps, for an answer that never comes
    assert not flood.poll(0)
    assert got == baseline
    tox.close()
    flood.close(0)
