"""Dynamic steering under tensor parallelism (two GPUs, or two CPU workers): every rank takes the same decisions and
keeps bit-identical controller state, outputs equal TP=1."""

from __future__ import annotations

import os

import numpy as np
import pytest

import dynsteer
from dynsteer import Action, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule, SyncControllerSpec
from tests.conftest import ON_GPU, cpu_tp_env, gpu_count, make_llm, token_ids


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(gpu_count() < 2 if ON_GPU else (os.cpu_count() or 1) < 2,
                                 reason="two CPU workers, or two GPUs with DYNSTEER_TEST_DEVICE=cuda")]
PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning", "she opened the door and"]


def policies(hidden: int) -> list[DynamicSteeringPolicy]:
    out = []
    for i, (scope, ctrl) in enumerate([
            ("this_token", SyncControllerSpec(kind="ema_latch", alpha=0.5, on=0.0, off=-1.0, scale=1.0)),
            ("next_step", None), ("rest_of_request", None),
            ("this_token", SyncControllerSpec(kind="pid", target=0.0, kp=0.5, ki=0.1, kd=0.0))]):
        rng = np.random.default_rng(i)
        probe = rng.standard_normal(hidden).astype(np.float32)
        mon = ProbeGate(name="m", layer=1, direction=probe / np.linalg.norm(probe), sharpness=2.0, threshold=0.0)
        act = Action(kind="add", layer=2, vector=rng.standard_normal(hidden).astype(np.float32) * 4)
        out.append(DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act], scope=scope)],
                                         controller=ctrl))
    return out


def run(path, tp: int):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with cpu_tp_env(tp):
        return _generate(path, tp, params)


def _generate(path, tp: int, params):
    # float32: TP=1 and TP=2 must agree token for token, which bf16 rounding of partial sums would not guarantee
    with make_llm(path, tensor_parallel_size=tp, dtype="float32", **DynsteerConfig(max_gates=2).engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        base = token_ids(llm.generate(PROMPTS, params))
        outs = st.generate(PROMPTS, params, policy=policies(st.hidden_size))
        # a second identical run, whose traces are taken from every rank
        params_list, tags = st._params(PROMPTS, params, None, policy=policies(st.hidden_size))
        llm.generate(PROMPTS, params_list)
        per_rank = st.take_traces(tags, all_ranks=True)
        states = [w["dynamic"]["controller_state"] for w in st.describe()]
    return base, token_ids(outs), [o.trace for o in outs], per_rank, tags, states


def test_tp2_ranks_decide_identically_and_match_tp1(tiny_llama_path):
    base2, steered2, traces2, per_rank, tags, states = run(tiny_llama_path, tp=2)
    assert len(per_rank) == 2
    for tag in tags:
        r0, r1 = per_rank[0][tag], per_rank[1][tag]
        assert r0.scale == r1.scale and r0.applied == r1.applied and r0.gate == r1.gate and r0.score == r1.score
    # the device controllers' whole state (every slot, bit for bit) is the same on both ranks, and not trivially:
    # the sync-controller requests of the last run left their final states behind
    assert states[0] == states[1] and states[0]["slots_nonzero"] >= 2, states
    base1, steered1, traces1, _, _, _ = run(tiny_llama_path, tp=1)
    assert steered2 != base2
    assert base2 == base1 and steered2 == steered1
    for t1, t2 in zip(traces1, traces2):
        np.testing.assert_allclose(t2.scale, t1.scale, atol=1e-6)
