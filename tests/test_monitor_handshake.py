"""A monitor against a real CPU engine (``vllm.LLM``, stepped by hand): the start handshake
(``Steerer.wait_for_subscribers``), frames naming requests by the ids vLLM's outputs show, commands addressed by
those ids, and two commands sent together for one frame taken at the same step."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

import dynsteer
from dynsteer.commands import AbortCommand, SteerCommand
from dynsteer.config import DynsteerConfig, MonitorConfig, StreamSpec
from dynsteer.monitor.client import MonitorClient
from dynsteer.spec import AddVector, SteeringSpec
from tests.conftest import make_llm

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning"]
MAX_TOKENS = 16
H = 128  # the tiny llama's hidden size
PUSH = SteeringSpec(vectors=[AddVector(layer=1, vector=np.random.default_rng(2).standard_normal(H).astype(
    np.float32) * 8, tier="decode")])  # changes every request's tokens


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    mon = MonitorConfig.private(streams={"resid": StreamSpec(places=("1.post_block",), requests="all",
                                                             positions="generated")})
    cfg = DynsteerConfig(capture_sites=("post_block",), capture_layers=(1,), monitor=mon)
    with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
        yield llm, cfg, dynsteer.attach(llm)


def _run(llm, names: list[str], on_step=None) -> dict[str, object]:
    """Greedy outputs of ``PROMPTS`` under the user ids ``names``, the engine stepped by hand; ``on_step(steps)``
    runs after each step."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, prompt in zip(names, PROMPTS):
        eng.add_request(name, prompt, params)
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if on_step is not None:
            on_step(steps)
    return done


def test_the_wait_for_subscribers_times_out_without_a_monitor_and_returns_with_one(engine):
    llm, cfg, st = engine
    with pytest.raises(TimeoutError, match=r"^timeout_s: 0 of 1 subscribers connected to stream 'resid'"):
        st.wait_for_subscribers("resid", 1, timeout_s=0.3)
    with pytest.raises(LookupError, match="name: no stream 'other'"):
        st.wait_for_subscribers("other", timeout_s=1)
    with MonitorClient(cfg.monitor.endpoint, cfg.monitor.command_endpoint, name="hs", streams=["resid"]):
        assert st.wait_for_subscribers("resid", 1, timeout_s=30) == ["hs"]


def test_frames_show_user_ids_and_commands_sent_together_by_user_id_land_at_one_step(engine):
    llm, cfg, st = engine
    tag = uuid.uuid4().hex[:6]
    baseline = _run(llm, [f"base{tag}-{i}" for i in range(3)])
    names = [f"{tag}{i}" for i in range(3)]
    frames: list = []
    with MonitorClient(cfg.monitor.endpoint, cfg.monitor.command_endpoint, name="hs", streams=["resid"],
                       max_pending=4096) as mon:
        st.wait_for_subscribers("resid", 1, timeout_s=30)

        def on_step(steps: int) -> None:
            while (frame := mon.recv(0.5 if steps == 3 and not frames else 0)) is not None:
                frames.append(frame)
            if steps == 3:  # one frame in hand: abort one request and steer another, both named as outputs do
                frame = flagged[0] = frames[-1]
                assert sorted(frame.user_ids) == names
                assert all(r.startswith(u + "-") and len(r) == len(u) + 9 for r, u in zip(frame.req_ids,
                                                                                        frame.user_ids))
                # sent now, acks collected once the engine stepped (it runs in this thread)
                pending.extend(mon.send(c) for c in (AbortCommand(request=names[1], reason="flagged"),
                                                     SteerCommand(request=names[0], spec=PUSH)))
                time.sleep(0.5)  # both reach the engine core's socket before the next step drains it

        pending: list = []
        flagged: list = [None]
        outs = _run(llm, names, on_step)
        acks = [p.result(timeout_s=10) for p in pending]
    engine_id = dict(zip(flagged[0].user_ids, flagged[0].req_ids))
    assert [a.status for a in acks] == ["applied", "applied"]
    assert acks[0].step == acks[1].step  # sent together for one frame: taken at the same step
    assert [a.request for a in acks] == [engine_id[names[1]], engine_id[names[0]]]
    base = [list(baseline[f"base{tag}-{i}"].outputs[0].token_ids) for i in range(3)]
    got = [list(outs[n].outputs[0].token_ids) for n in names]
    assert outs[names[1]].outputs[0].finish_reason == "abort"
    assert "hs" in str(outs[names[1]].outputs[0].stop_reason) and len(got[1]) < MAX_TOKENS
    assert got[0] != base[0] and got[0][:2] == base[0][:2]  # steered from the acked step on, not before
    assert got[2] == base[2]  # the request no command named is untouched
