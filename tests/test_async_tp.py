"""Monitor commands under tensor parallelism (two CPU workers): a command lands on both ranks at the same step, the
ranks' traces agree, and outputs equal TP=1 given the same command at the same step."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import dynsteer
from dynsteer import Action, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule
from dynsteer.commands import SteerCommand, ThresholdCommand
from dynsteer.config import MonitorConfig
from dynsteer.monitor.client import CommandClient
from dynsteer.spec import AddVector, SteeringSpec
from tests.conftest import ON_GPU, cpu_tp_env, gpu_count, make_llm, with_inprocess_engine_core

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(gpu_count() < 2 if ON_GPU else (os.cpu_count() or 1) < 2,
                                 reason="two CPU workers, or two GPUs with DYNSTEER_TEST_DEVICE=cuda")]
PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning"]


def _policy(hidden: int) -> DynamicSteeringPolicy:
    rng = np.random.default_rng(3)
    probe = rng.standard_normal(hidden).astype(np.float32)
    mon = ProbeGate(name="m", layer=1, direction=probe / np.linalg.norm(probe), sharpness=2.0, threshold=50.0)
    act = Action(kind="add", layer=2, vector=rng.standard_normal(hidden).astype(np.float32) * 4)
    return DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act], scope="this_token")])


def _run(path, tp: int, command_at: int = 6):
    from vllm import SamplingParams

    cfg = DynsteerConfig(max_gates=2, monitor=MonitorConfig.private())
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with cpu_tp_env(tp):
        return with_inprocess_engine_core(_generate, path, tp, command_at, cfg, params)


def _generate(path, tp, command_at, cfg, params):
    with make_llm(path, tensor_parallel_size=tp, dtype="float32", **cfg.engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        hidden = st.hidden_size
        plist, tags = st._params(PROMPTS, params, None, policy=[_policy(hidden), None, None])
        engine = llm.llm_engine
        for i, (prompt, p) in enumerate(zip(PROMPTS, plist)):
            engine.add_request(f"r{i}", prompt, p)
        sched = engine.engine_core.engine_core.scheduler
        client = CommandClient(cfg.monitor.command_endpoint, "tp-test")
        outputs, sent, steps = {}, [], 0
        while engine.has_unfinished_requests():
            if steps == command_at:
                ids = sorted(sched.requests)  # the engine's ids ("r0-<suffix>"...), sorted as the prompts
                sent = [client.send(ThresholdCommand(request=ids[0], monitor="m", threshold=-50.0)),
                        client.send(SteerCommand(request=ids[1], spec=SteeringSpec(vectors=[AddVector(
                            layer=1, vector=np.random.default_rng(5).standard_normal(hidden).astype(np.float32) * 6,
                            tier="decode")])))]
                time.sleep(0.5)  # delivered before the next step's schedule() drains the socket
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
        acks = [client.wait(c, 10) for c in sent]
        client.close()
        per_rank = st.take_traces([tags[0]], all_ranks=True)
    ordered = [outputs[k] for k in sorted(outputs)]
    return ordered, acks, per_rank, tags[0]


def test_commands_land_on_both_ranks_at_the_same_step_and_tp2_equals_tp1(tiny_llama_path):
    out2, acks2, per_rank, tag = _run(tiny_llama_path, tp=2)
    assert [a.status for a in acks2] == ["applied", "applied"], acks2
    assert len(per_rank) == 2
    r0, r1 = per_rank[0][tag], per_rank[1][tag]
    assert r0.applied == r1.applied and r0.gate == r1.gate and r0.score == r1.score
    applied = [a[0] for a in r0.applied]
    assert applied[0] < 1e-3 and max(applied) > 0.5  # the moved threshold made the gate act from that step on
    out1, acks1, _, _ = _run(tiny_llama_path, tp=1)
    assert [a.step for a in acks1] == [a.step for a in acks2]
    assert out1 == out2
    # the commands changed both targeted requests; the third request is untouched by construction
    base2, _, _, _ = _run(tiny_llama_path, tp=1, command_at=10_000)
    assert out1[0] != base2[0] and out1[1] != base2[1] and out1[2] == base2[2]
