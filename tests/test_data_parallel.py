"""Data parallel 2: ``dynsteer serve --data-parallel-size 2`` (two engine cores behind one API server, tiny Llama on
CPU, or on two GPUs with ``DYNSTEER_TEST_DEVICE=cuda``).

A global policy set over HTTP steers requests on both replicas and clearing it restores them byte for byte; each
replica describes itself; one monitor process receives both replicas' frames (each naming its replica) and aborts
one request on each, while the other requests stay byte-identical to an unsteered run. Which replica served a
request is read from the frames of its stream.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import openai
import pytest

from dynsteer import Action, AddVector, DynamicSteeringPolicy, ProbeGate, Rule
from dynsteer.commands import AbortCommand
from dynsteer.config import MonitorConfig, StreamSpec, replica_endpoint
from dynsteer.monitor.client import MonitorClient
from dynsteer.spec import SteeringValidationError
from tests.conftest import ON_GPU, console_script, env, gpu_count, http_json, served

KEY = "dp-key-51c2"
HIDDEN, MON_LAYER, ACT_LAYER = 128, 1, 2
PROMPTS = ["the quick brown fox", "once upon a time", "hello world, this is", "a b c d e"]
SHORT, LONG = 8, 200

needs_two_replicas = pytest.mark.skipif(ON_GPU and gpu_count() < 2,
                                        reason="data parallel 2 on GPU needs two visible GPUs")


def always_on_policy() -> DynamicSteeringPolicy:
    """A gate open on every generated token, adding a large vector at layer 2."""
    d = np.eye(HIDDEN, dtype=np.float32)[0]
    v = (np.random.default_rng(1).standard_normal(HIDDEN) * 8.0).astype(np.float32)
    return DynamicSteeringPolicy(
        monitors=[ProbeGate(name="m", layer=MON_LAYER, direction=d, sharpness=4.0, threshold=-1e3)],
        rules=[Rule(monitor="m", actions=[Action(kind="add", layer=ACT_LAYER, vector=v)])])


@pytest.fixture(scope="module")
def monitor_cfg() -> MonitorConfig:
    return MonitorConfig.private(streams={"resid": StreamSpec(places=("1.post_block",), requests="all",
                                                             positions="generated")})


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory, monitor_cfg):
    """``dynsteer serve --data-parallel-size 2``; yields (base url, model)."""
    log = tmp_path_factory.mktemp("serve-dp") / "server.log"
    cfg = {"max_gates": 2, "max_rows": 16, "capture_sites": ["post_block"], "capture_layers": [1],
           "monitor": monitor_cfg.model_dump(mode="json")}
    exe = str(console_script())
    command = (lambda port, args: [exe, "serve", str(tiny_llama_path), "--host", "127.0.0.1", "--port", str(port),
                                   "--max-model-len", "256", "--max-num-seqs", "8", "--api-key", KEY, "--seed", "0",
                                   "--data-parallel-size", "2", "--additional-config", json.dumps({"dynsteer": cfg}),
                                   *args])
    # on CPU each engine core runs one OpenMP thread; vLLM binds them itself
    with env(VLLM_CPU_OMP_THREADS_BIND=None), served(command, log, timeout_s=600) as url:
        yield url, str(tiny_llama_path)


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300) as c:
        yield c


def steering(server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    url, _ = server
    return http_json(f"{url}/v1/steering/{path}", method, body, KEY)


class Watcher:
    """One monitor on both replicas' streams, in a thread: notes which replica served each request (by the
    frames' header) and, with ``abort_one_per_replica``, aborts the first request it sees on each replica."""

    def __init__(self, cfg: MonitorConfig, name: str, abort_one_per_replica: bool = False) -> None:
        self.mon = MonitorClient(cfg.endpoint, cfg.command_endpoint, name=name, streams=["resid"], replicas=2)
        self.replica_of: dict[str, int] = {}  # user id -> replica
        self.aborted: dict[int, tuple[str, Any]] = {}  # replica -> (user id, ack)
        self.abort = abort_one_per_replica
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            frame = self.mon.recv(0.2)
            if frame is None:
                continue
            for uid in frame.user_ids:
                self.replica_of[uid] = frame.replica
                if self.abort and frame.replica not in self.aborted:
                    pending = self.mon.send(AbortCommand(request=uid, reason="dp test"))
                    assert pending.replica == frame.replica
                    self.aborted[frame.replica] = (uid, pending.ack(60))

    def served_by(self, response_id: str) -> int:
        hits = {r for uid, r in self.replica_of.items() if uid == response_id or uid.startswith(response_id + "-")}
        assert len(hits) == 1, (response_id, self.replica_of)
        return hits.pop()

    def __enter__(self) -> "Watcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)
        self.mon.close()


def complete_all(client, model: str, max_tokens: int) -> list[Any]:
    """The prompts sent together (so the API server spreads them over both replicas); greedy, ignoring EOS."""
    def one(prompt: str) -> Any:
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def texts(outs: list[Any]) -> list[str]:
    return [o.choices[0].text for o in outs]


@pytest.fixture(scope="module")
def baseline(server, client) -> dict[int, list[str]]:
    """Unsteered outputs, one request at a time."""
    _, model = server
    return {n: [client.completions.create(model=model, prompt=p, max_tokens=n, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
            for n in (SHORT, LONG)}


def test_each_replica_binds_its_own_endpoints():
    mon = MonitorConfig(endpoint="ipc:///run/x/streams", command_endpoint="ipc:///run/x/commands")
    assert mon.for_replica(0) is mon
    assert (mon.for_replica(2).endpoint, mon.for_replica(2).command_endpoint) == \
        ("ipc:///run/x/streams.dp2", "ipc:///run/x/commands.dp2")
    assert replica_endpoint("tcp://127.0.0.1:5555", 1) == "tcp://127.0.0.1:5655"


def test_a_command_for_a_request_no_replica_showed_is_refused_naming_it(monitor_cfg):
    with MonitorClient(monitor_cfg.endpoint, monitor_cfg.command_endpoint, name="dp-none", replicas=2) as mon:
        with pytest.raises(SteeringValidationError, match="command.request: request 'cmpl-nowhere-0' appeared in "
                                                          "no frame of this engine's 2 data-parallel replicas"):
            mon.abort("cmpl-nowhere-0")
    with pytest.raises(SteeringValidationError, match="replicas: 0"):
        MonitorClient(monitor_cfg.endpoint, monitor_cfg.command_endpoint, name="dp-none", replicas=0)


def test_a_state_change_is_queued_on_every_replica_before_the_first_await():
    """vLLM's client gathers its per-engine sends as tasks (they start at the loop's next turn); the control RPCs
    the API server sends must already be on every replica's socket when the route first yields, so a request
    admitted meanwhile cannot overtake them."""
    import asyncio

    from dynsteer.engine.replicas import rpc_in_order

    class Client:  # the part of vLLM's DPLBAsyncMPClient that rpc_in_order drives
        core_engines, client_index = [b"\x00\x00", b"\x01\x00"], 0
        encoder = type("Enc", (), {"encode": staticmethod(lambda obj: [json.dumps(obj[2:]).encode()])})()

        def __init__(self) -> None:
            self.utility_results: dict[int, Any] = {}
            self.sent: list[tuple[bytes, bytes]] = []

        def _send_input_message(self, message: tuple, engine: bytes, objects: Any) -> Any:
            self.sent.append((engine, message[-1]))
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

        def _ensure_output_queue_task(self) -> None:
            pass

    async def main() -> list[Any]:
        client = Client()
        call = asyncio.ensure_future(rpc_in_order(type("E", (), {"engine_core": client})(), "m", ("x",)))
        await asyncio.sleep(0)  # the route's first turn: both messages are out, none answered yet
        assert [e for e, _ in client.sent] == client.core_engines and not call.done()
        assert {json.loads(m)[0] for _, m in client.sent} == {"collective_rpc"}
        for i, reply in enumerate(client.utility_results.values()):
            reply.set_result([f"replica {i}"])
        return await call

    assert asyncio.run(main()) == ["replica 0"]


@needs_two_replicas
def test_capabilities_and_each_replica_describe_itself(server):
    status, caps = steering(server, "GET", "capabilities")
    assert status == 200 and caps["data_parallel_size"] == 2, caps
    status, reply = steering(server, "GET", "replicas")
    assert status == 200 and [r["replica"] for r in reply["replicas"]] == [0, 1], reply
    for r in reply["replicas"]:
        (worker,) = r["workers"]
        assert worker["shape"]["hidden_size"] == HIDDEN and worker["global_empty"]


@needs_two_replicas
def test_a_global_policy_over_http_steers_both_replicas_and_clearing_restores_them(server, client, monitor_cfg,
                                                                                      baseline):
    _, model = server
    # the start handshake counts a monitor once it is connected at every replica
    with MonitorClient(monitor_cfg.endpoint, monitor_cfg.command_endpoint, name="dp-half", streams=["resid"]):
        status, reply = steering(server, "GET", "streams/resid/subscribers?timeout_s=1")
        assert status == 504 and "0 of 1 subscribers" in json.dumps(reply), reply
    with Watcher(monitor_cfg, "dp-watch") as w:
        status, reply = steering(server, "GET", "streams/resid/subscribers?min=1&timeout_s=60")
        assert status == 200 and reply["subscribers"] == ["dp-watch"], reply
        plain = complete_all(client, model, SHORT)
        assert texts(plain) == baseline[SHORT]
        assert {w.served_by(o.id) for o in plain} == {0, 1}  # both replicas served some

        status, reply = steering(server, "PUT", "policy", {"policy": always_on_policy().model_dump(mode="json")})
        assert status == 200 and reply["policy"] is not None, reply
        status, described = steering(server, "GET", "replicas")
        assert status == 200 and [r["workers"][0]["dynamic"]["global_policy"] for r in described["replicas"]] == \
            [True, True], described
        steered = complete_all(client, model, SHORT)
        assert {w.served_by(o.id) for o in steered} == {0, 1}
        for got, want in zip(texts(steered), baseline[SHORT]):
            assert got != want  # every request on either replica is steered

        status, _ = steering(server, "DELETE", "policy")
        assert status == 200
        cleared = complete_all(client, model, SHORT)
        assert {w.served_by(o.id) for o in cleared} == {0, 1}
    assert texts(cleared) == baseline[SHORT]
    status, described = steering(server, "GET", "replicas")
    assert [r["workers"][0]["dynamic"]["global_policy"] for r in described["replicas"]] == [False, False]


@needs_two_replicas
def test_one_monitor_aborts_one_request_on_each_replica_and_leaves_the_others_alone(server, client, monitor_cfg,
                                                                                       baseline):
    _, model = server
    with Watcher(monitor_cfg, "dp-abort", abort_one_per_replica=True) as w:
        outs = complete_all(client, model, LONG)
    assert sorted(w.aborted) == [0, 1], w.aborted
    aborted_ids = set()
    for replica, (uid, ack) in w.aborted.items():
        assert ack.status == "applied" and ack.request.startswith(uid), ack
        aborted_ids.add(uid)
    for out, want in zip(outs, baseline[LONG]):
        choice = out.choices[0]
        if any(uid == out.id or uid.startswith(out.id + "-") for uid in aborted_ids):
            assert choice.finish_reason != "length" and out.usage.completion_tokens < LONG
        else:
            assert choice.finish_reason == "length" and choice.text == want
    assert len(aborted_ids) == 2
