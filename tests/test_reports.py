"""Per-request reports (payload ``report``): what steering did, returned with the outputs, in Python and over HTTP.

A ``tokens`` report's values equal the engine's trace of the same request (the Python API's dynamic trace); streamed
chunks carry exactly the values of the tokens they deliver; a request without a report is untouched. Tiny Llama on
CPU: one in-process engine and one ``dynsteer serve`` per module.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import openai
import pytest

import dynsteer
from dynsteer import Action, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule, SteeringValidationError
from dynsteer.request.payload import decode_payload, with_tag
from tests.conftest import env, make_llm, served, token_ids, unit, vec

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning"]
MON_LAYER, ACT_LAYER = 1, 2
N = 12
KEY = "report-key-1"


def greedy(n: int = N, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def policy(hidden: int, threshold: float = 0.0, sharpness: float = 2.0, abort: str | None = None):
    mon = ProbeGate(name="m", layer=MON_LAYER, direction=unit(hidden, 0), sharpness=sharpness, threshold=threshold)
    act = Action(kind="add", layer=ACT_LAYER, vector=vec(hidden, 1))
    rule = Rule(monitor="m", actions=[act], **({"abort": abort} if abort else {}))
    return DynamicSteeringPolicy(monitors=[mon], rules=[rule])


def check_against_trace(report: dict, trace, n_tokens: int) -> None:
    """A tokens report equals the trace: token i's values are the trace's row at the position before it."""
    assert report["report"] == "tokens" and report["monitors"] == trace.monitors
    assert len(report["score"]) == len(report["gate"]) == n_tokens
    assert report["score"][0] is None and report["gate"][0] is None  # produced by the prompt's forward
    assert len(trace) == n_tokens - 1
    np.testing.assert_allclose(np.array(report["score"][1:], np.float64), np.array(trace.score), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.array(report["gate"][1:], np.float64), np.array(trace.applied), atol=1e-6, rtol=0)
    check_summary(report["summary"], trace)


def check_summary(summary: dict, trace) -> None:
    applied = np.array(trace.applied, np.float64).reshape(len(trace), -1)
    steered = int((applied != 0).any(axis=1).sum())
    assert summary["acted"] == (steered > 0) and summary["tokens_steered"] == steered
    assert [r["monitor"] for r in summary["rules"]] == trace.monitors
    for g, rule in enumerate(summary["rules"]):
        assert rule["max_gate"] == pytest.approx(applied[:, g].max(), abs=1e-6)
        assert rule["max_score"] == pytest.approx(max(trace.scores(g)), abs=1e-6)
        assert rule["last_score"] == pytest.approx(trace.scores(g)[-1], abs=1e-6)


# ---- payload ---------------------------------------------------------------------------------------------------------
def test_payload_report_field_round_trips_and_is_checked():
    assert decode_payload(dynsteer.encode_payload(report="tokens")).report == "tokens"
    assert decode_payload(dynsteer.encode_payload()).report is None
    assert decode_payload({"report": "summary"}).report == "summary"
    with pytest.raises(SteeringValidationError, match=r"extra_args\.dynsteer\.report"):
        decode_payload({"report": "everything"})


# ---- in process ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    cfg = DynsteerConfig(max_gates=2)
    with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
        yield llm, dynsteer.attach(llm)


def test_tokens_report_equals_the_trace_in_process(engine):
    llm, st = engine
    outs = st.generate(PROMPTS, greedy(), policy=policy(st.hidden_size), report="tokens")
    for out in outs:
        comp = out.outputs[0]
        check_against_trace(comp.dynsteer, out.trace, len(comp.token_ids))
    assert any(o.outputs[0].dynsteer["summary"]["acted"] for o in outs)


def test_summary_report_and_requests_without_one(engine):
    llm, st = engine
    pol = policy(st.hidden_size)
    plain = st.generate(PROMPTS, greedy(), policy=pol)
    summ = st.generate(PROMPTS, greedy(), policy=pol, report="summary")
    assert token_ids(plain) == token_ids(summ)  # asking for a report changes nothing generated
    for p, s in zip(plain, summ):
        assert not hasattr(p.outputs[0], "dynsteer")
        rep = s.outputs[0].dynsteer
        assert set(rep) == {"report", "summary"} and rep["report"] == "summary"
        check_summary(rep["summary"], s.trace)
    # no policy at all: a report says nothing acted, token by token
    outs = st.generate(PROMPTS[:1], greedy(), report="tokens")
    rep = outs[0].outputs[0].dynsteer
    assert rep["score"] == [None] * N and rep["summary"] == {"acted": False, "tokens_steered": 0, "abort": None,
                                                             "rules": []}


def test_plain_llm_with_a_packed_payload(engine):
    llm, st = engine
    payload = dynsteer.encode_payload(policy=policy(st.hidden_size), report="tokens", trace=True)
    sp = greedy(extra_args={"dynsteer": with_tag(payload, "plain-llm")})
    out = llm.generate(PROMPTS[:1], sp)[0]
    trace = st.take_traces(["plain-llm"])["plain-llm"]
    check_against_trace(out.outputs[0].dynsteer, trace, N)


def test_abort_reason_in_the_summary(engine):
    llm, st = engine
    outs = st.generate(PROMPTS[:1], greedy(), policy=policy(st.hidden_size, threshold=-1e9, abort="too much"),
                       report="summary")
    summ = outs[0].outputs[0].dynsteer["summary"]
    assert outs[0].outputs[0].finish_reason == "abort" and "too much" in summ["abort"]
