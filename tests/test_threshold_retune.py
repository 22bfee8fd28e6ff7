"""A monitor's ``threshold`` command reaches every copy of the gate's parameters.

A gate's sharpness, threshold and floor live in the request's table row (the in-graph gate), on the host (the
driver's gate formula for read-backs, the host tier's controllers) and, in the device sync tier, in the request's
slot of the controller state buffer (the carried gates of ``next_step`` / ``rest_of_request`` rules). A command
moving the threshold mid-generation must move all of them at the same step: the device tier then decides exactly as
the host tier (which reads the host copy) does, token for token, and the carried gate follows the new threshold.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import dynsteer
from dynsteer import Action, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule, SyncControllerSpec
from dynsteer.commands import ThresholdCommand
from dynsteer.config import MonitorConfig
from dynsteer.monitor.client import CommandClient
from tests.conftest import make_llm, with_inprocess_engine_core

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning", "she opened the door and"]
CASES = ("this_token", "next_step", "rest_of_request", "controller")
COMMAND_AT, TOKENS, OLD, NEW, SHARP = 5, 16, 50.0, -50.0, 2.0


def _policy(case: str, hidden: int) -> DynamicSteeringPolicy:
    """A gate that never opens at ``OLD`` and always at ``NEW``; its rule adds a strong vector at layer 2."""
    rng = np.random.default_rng(3)
    probe = rng.standard_normal(hidden)
    mon = ProbeGate(name="m", layer=1, direction=(probe / np.linalg.norm(probe)).astype(np.float32), sharpness=SHARP,
                  threshold=OLD)
    act = Action(kind="add", layer=2, vector=(rng.standard_normal(hidden) * 4).astype(np.float32))
    scope = "next_step" if case == "controller" else case
    controller = (SyncControllerSpec(kind="latch", monitor="m", on=-1e3, off=-2e3, scale=1.0)
                  if case == "controller" else None)  # always on: the rule's carried gate decides
    return DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act], scope=scope)],
                                 controller=controller)


def _run(path, tier: str, command: bool) -> dict:
    cfg = DynsteerConfig(max_gates=2, sync_tier=tier, monitor=MonitorConfig.private())
    return with_inprocess_engine_core(_generate, path, cfg, command)


def _generate(path, cfg, command: bool) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    with make_llm(path, **cfg.engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        policies = [_policy(case, st.hidden_size) for case in CASES]
        plist, tags = st._params(PROMPTS, params, None, policy=policies)
        engine = llm.llm_engine
        for i, (prompt, p) in enumerate(zip(PROMPTS, plist)):
            engine.add_request(f"r{i}", prompt, p)
        sched = engine.engine_core.engine_core.scheduler
        client = CommandClient(cfg.monitor.command_endpoint, "retune")
        outputs, sent, steps = {}, [], 0
        while engine.has_unfinished_requests():
            if command and steps == COMMAND_AT:
                ids = sorted(sched.requests)  # the engine's ids, in prompt order
                sent = [client.send(ThresholdCommand(request=rid, monitor="m", threshold=NEW)) for rid in ids]
                time.sleep(0.5)  # delivered before the next step's schedule() drains the socket
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
        acks = [client.wait(c, 10) for c in sent]
        client.close()
        traces = st.take_traces(tags)
        described = st.describe()[0]
    return {"tokens": [outputs[k] for k in sorted(outputs)], "acks": acks,
            "traces": [traces[t] for t in tags], "described": described}


@pytest.fixture(scope="module")
def runs(tiny_llama_path):
    return {(tier, command): _run(tiny_llama_path, tier, command)
            for tier, command in (("device", True), ("host", True), ("device", False))}


def test_device_tier_really_carries_the_gates(runs):
    """The sync-tier requests ran in the device tier (else this file would test the host copy twice)."""
    sync = runs[("device", True)]["described"]["dynamic"]
    assert sync.get("device_slots_exhausted", 0) == 0
    assert all(a.status == "applied" for a in runs[("device", True)]["acks"])
    assert len({a.step for a in runs[("device", True)]["acks"]}) == 1  # one step for all four


@pytest.mark.parametrize("case", CASES)
def test_a_threshold_command_moves_every_copy_of_the_gate(runs, case):
    i = CASES.index(case)
    device, host, still = runs[("device", True)], runs[("host", True)], runs[("device", False)]
    trace = device["traces"][i]
    gates, applied, scores = trace.gates("m"), trace.applied_gates("m"), trace.scores("m")
    # the command acted: the request's tokens leave the uncommanded run's
    assert device["tokens"][i] != still["tokens"][i]
    # before the command the gate is shut, after it open, by the formula with each threshold
    moved = np.flatnonzero(gates > 0.5)
    assert len(moved) and moved[0] > 0
    first = int(moved[0])
    np.testing.assert_allclose(gates[:first], 1 / (1 + np.exp(-SHARP * (scores[:first] - OLD))), atol=1e-6)
    np.testing.assert_allclose(gates[first:], 1 / (1 + np.exp(-SHARP * (scores[first:] - NEW))), atol=1e-6)
    # the applied gate follows the new threshold from the command's step on, by scope
    if case in ("next_step", "controller"):  # the previous token's gate, carried on the device
        np.testing.assert_allclose(applied[first + 1:], gates[first:-1], atol=1e-6)
    else:  # this token's gate (rest_of_request: and held once it fired)
        assert (applied[first:] > 0.5).all()
    # the device tier decided exactly as the host tier, which reads the host copy of the parameters
    assert device["tokens"][i] == host["tokens"][i]
    np.testing.assert_allclose(applied, host["traces"][i].applied_gates("m"), atol=1e-6)
    np.testing.assert_allclose(gates, host["traces"][i].gates("m"), atol=1e-6)
