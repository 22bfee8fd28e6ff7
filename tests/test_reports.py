"""Per-request reports (payload ``report``): what steering did, returned with the outputs, in Python and over HTTP.

A ``tokens`` report's values equal the engine's trace of the same request (the Python API's dynamic trace); streamed
chunks carry exactly the values of the tokens they deliver; a request without a report is untouched. Tiny Llama on
CPU: one in-process engine and one ``dynsteer serve`` per module.
"""

from __future__ import annotations


import numpy as np
import openai
import pytest

import dynsteer
from dynsteer import Action, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule, SteeringValidationError
from dynsteer.engine.keys import REPORT_PARAMS_KEY
from dynsteer.engine.reports import ReportRelay
from dynsteer.request.payload import decode_payload, with_tag
from dynsteer.trace import ReportValues, merge_reports
from tests.conftest import ON_GPU, dynsteer_served, make_llm, token_ids, unit, vec

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


def test_reports_of_a_step_gathered_at_once_equal_each_requests_own():
    """The worker's step flush (``ReportCursors.flush_all``: every report request's landed values gathered from the
    records at once) sends exactly what flushing each request by itself sends: requests with different slot counts,
    a prompt-level slot, a step landing 0 to 3 values per request, records that grow, a request whose header is not
    sent yet, one without a state and one without a record."""
    from types import SimpleNamespace

    from dynsteer.device.readback import ReadbackStore
    from dynsteer.steering.dynamic.reports import ReportCursors
    from dynsteer.steering.dynamic.state import DynState

    rng = np.random.default_rng(1)
    G = 3
    store = ReadbackStore(4 * G + 1, slots=2, length=2)  # small: both grow while the test runs

    def state(prompt_slots, record=True):
        st = SimpleNamespace(slots=[SimpleNamespace(prompt=p, monitor=f"m{i}", scope="this_token", acts=True)
                                    for i, p in enumerate(prompt_slots)],
                             record=store.acquire() if record else None, prompt_level=any(prompt_slots))
        st.report_fields = lambda p, v, st=st: DynState.report_fields(st, p, v)
        return st

    states = {"a": state([False, False]), "b": state([False, True, False]), "c": state([False]),
              "none": None, "norecord": state([False], record=False), "late": state([True, False])}
    one, batched = ReportCursors(), ReportCursors()
    for cursors in (one, batched):
        for req_id, st in states.items():
            if req_id != "late":
                cursors.start(req_id, "tokens", st, store)
    last = {r: 9 for r in states}
    for step in range(12):
        if step == 3:
            for cursors in (one, batched):
                cursors.start("late", "tokens", states["late"], store)
        slot, position = [], []
        for req_id, st in states.items():
            if st is None or st.record is None:
                continue
            for _ in range(int(rng.integers(0, 4))):
                last[req_id] += 1
                slot.append(st.record)
                position.append(last[req_id])
        block = rng.standard_normal((4 * G + 1, len(slot))).astype(np.float32)
        store.append(np.array(slot, np.int64), np.array(position, np.int64), block)
        for req_id in list(one.sent):
            if states[req_id] is not None:
                one.flush(req_id, states[req_id], store)
        batched.flush_all(states.get, store)
        want, got = one.take(), batched.take()
        assert sorted(got) == sorted(want), (step, sorted(got), sorted(want))
        np.testing.assert_equal(got, want)
        assert one.sent == batched.sent
    assert sum(len(v) for v in want.values()) > 0


def test_report_fields_are_the_traces_fields():
    """What a report request's worker computes every step equals the trace's fields (NaN score of a prompt-level
    slot included), read-back values that are not float32-exact in float64 too."""
    from types import SimpleNamespace

    from dynsteer.steering.dynamic.state import DynState

    rng = np.random.default_rng(0)
    for prompt_slots in ([False, False], [False, True]):
        slots = [SimpleNamespace(prompt=p) for p in prompt_slots]
        st = SimpleNamespace(slots=slots, params=np.ones((3, 2), np.float32), retunes=[], retune_pending=None,
                             prompt_level=any(prompt_slots))
        st.params_at = lambda p, st=st: DynState.params_at(st, p)
        st.report_fields = lambda p, v, st=st: DynState.report_fields(st, p, v)
        positions = np.arange(7, 12)
        values = rng.standard_normal((5, 4 * 3 + 1)).astype(np.float32)  # G = 3 slots read back, 2 used
        got, want = DynState.report_fields(st, positions, values), DynState.trace(st, positions, values)
        assert set(got) == {"position", "score", "applied"}
        for key in got:
            np.testing.assert_array_equal(np.array(got[key], np.float64), np.array(want[key], np.float64))


# ---- payload ---------------------------------------------------------------------------------------------------------
def test_payload_report_field_round_trips_and_is_checked():
    assert decode_payload(dynsteer.encode_payload(report="tokens")).report == "tokens"
    assert decode_payload(dynsteer.encode_payload()).report is None
    assert decode_payload({"report": "summary"}).report == "summary"
    with pytest.raises(SteeringValidationError, match=r"extra_args\.dynsteer\.report"):
        decode_payload({"report": "everything"})


def test_report_values_align_tokens_with_the_forward_that_produced_them():
    rv = ReportValues(prompt_len=3)
    rv.add({"report": "tokens", "monitors": ["m"], "scopes": ["this_token"], "acts": [True],
            "position": [3, 4], "score": [[0.5], [float("nan")]], "applied": [[0.25], [0.0]]})
    assert rv.covered(1) and rv.covered(3) and not rv.covered(4)
    rep = rv.json(0, 3, final=True)
    assert rep["score"] == [None, [0.5], [None]] and rep["gate"] == [None, [0.25], [0.0]]
    assert rep["summary"] == {"acted": True, "tokens_steered": 1, "abort": None,
                              "rules": [{"monitor": "m", "scope": "this_token", "acts": True, "max_gate": 0.25,
                                         "max_score": 0.5, "last_score": 0.5}]}
    assert merge_reports(rv.json(0, 1, False), rv.json(1, 3, True)) == rep
    rv.kind = "summary"
    assert rv.json(0, 2, final=False) is None and set(rv.json(0, 3, final=True)) == {"report", "summary"}


def test_the_relays_coverage_agrees_with_the_report_values():
    """The engine core keeps only how far a request's values arrived; it answers covered() as the values would."""
    from dynsteer.engine.reports import _Coverage

    rng = np.random.default_rng(0)
    for _ in range(50):
        prompt_len, at = int(rng.integers(1, 6)), 0
        full, light = ReportValues(prompt_len), _Coverage(prompt_len)
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(0, 4))
            delta = {"position": list(range(prompt_len - 1 + at, prompt_len - 1 + at + n)),
                     "score": [[0.5]] * n, "applied": [[1.0]] * n}
            if rng.random() < 0.2:
                delta["done"] = True
            at += n
            full.add(delta), light.add(delta)
            assert [full.covered(t) for t in range(12)] == [light.covered(t) for t in range(12)]


def test_engine_core_relay_holds_a_final_output_until_its_values_arrive():
    from types import SimpleNamespace

    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    relay = ReportRelay()
    sched = SimpleNamespace(requests={"r": SimpleNamespace(num_prompt_tokens=4)})
    relay.fold(sched, {"r": {"report": "tokens", "monitors": ["m"], "scopes": ["this_token"], "acts": [True]}})
    first = EngineCoreOutput("r", [5])
    outputs = {0: EngineCoreOutputs(outputs=[first, EngineCoreOutput("other", [1])])}
    relay.deliver(outputs, EngineCoreOutputs)
    assert first.kv_transfer_params[REPORT_PARAMS_KEY]["monitors"] == ["m"]
    assert outputs[0].outputs[1].kv_transfer_params is None  # other requests are untouched
    relay.fold(sched, {"r": {"position": [4], "score": [[1.0]], "applied": [[0.5]]}})
    final = EngineCoreOutput("r", [6, 7], finish_reason=FinishReason.LENGTH, kv_transfer_params={"connector": 1})
    outputs = {0: EngineCoreOutputs(outputs=[final])}
    relay.deliver(outputs, EngineCoreOutputs)  # 3 tokens need positions 4 and 5: held
    assert outputs[0].outputs == [] and relay.held == {"r"}
    relay.fold(sched, {"r": {"position": [5], "score": [[2.0]], "applied": [[0.75]], "done": True}})
    outputs = {}
    relay.deliver(outputs, EngineCoreOutputs)
    assert outputs[0].outputs == [final] and not relay.held and not relay.buffers
    assert final.kv_transfer_params["connector"] == 1  # merged with what a KV connector put there
    assert final.kv_transfer_params[REPORT_PARAMS_KEY] == {"position": [4, 5], "score": [[1.0], [2.0]],
                                                           "applied": [[0.5], [0.75]], "done": True}


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


class _LateEvent:
    """A read-back copy that reports itself done only at its sixth query, a step or two after its step (a step polls a
    few times; on CPU copies are done at once)."""

    def __init__(self) -> None:
        self.asked = 0

    def query(self) -> bool:
        self.asked += 1
        return self.asked > 5

    def synchronize(self) -> None:
        self.asked = 6


@pytest.fixture
def late_readbacks(monkeypatch):
    """Read-backs land a step or so after their token, as on a GPU, where the host never waits for them."""
    from dynsteer.steering.dynamic import driver

    orig = driver.DynamicDriver._launch_readback

    def launch(self, lookup):
        n = len(self._pending)
        orig(self, lookup)
        for pend in self._pending[n:]:
            pend.event = pend.event or _LateEvent()

    monkeypatch.setattr(driver.DynamicDriver, "_launch_readback", launch)


@pytest.mark.skipif(ON_GPU, reason="patches the read-back in this process; GPU engines run in a process of their own, "
                                    "where read-backs really land late (the HTTP tests cover that)")
def test_late_values_hold_deltas_and_the_final_output(engine, late_readbacks):
    """Streamed deltas wait for their tokens' values and the final output for its last ones; each delta still
    carries exactly its tokens' values, equal to the trace. A step waits for the read-backs before its own, so a
    token's values come one step after it: each delta is held for one step, and only the last two go out together."""
    from vllm.sampling_params import RequestOutputKind

    llm, st = engine
    eng = llm.llm_engine
    payload = dynsteer.encode_payload(policy=policy(st.hidden_size), report="tokens", trace=True)
    for i, prompt in enumerate(PROMPTS):
        sp = greedy(extra_args={"dynsteer": with_tag(payload, f"late-{i}")})
        sp.output_kind = RequestOutputKind.DELTA
        eng.add_request(f"late-{i}", prompt, sp)
    chunks: dict[str, list] = {}
    steps = dict.fromkeys((f"late-{i}" for i in range(len(PROMPTS))), 0)  # steps each request was waited on
    while eng.has_unfinished_requests():
        for req_id in steps:
            if not chunks.get(req_id) or chunks[req_id][-1].finish_reason is None:
                steps[req_id] += 1
        for out in eng.step():
            chunks.setdefault(out.request_id, []).append(out.outputs[0])
    for i, prompt in enumerate(PROMPTS):
        score, gate, n, sizes = [], [], 0, []
        for comp in chunks[f"late-{i}"]:
            rep = comp.dynsteer
            assert len(rep["score"]) == len(rep["gate"]) == len(comp.token_ids)
            score, gate, n = score + rep["score"], gate + rep["gate"], n + len(comp.token_ids)
            sizes.append(len(comp.token_ids))
        # values one step late: no delta waited long enough to be merged with the next, but the final output (held
        # by the engine core until its values came) carries the token before it, whose values came with it
        assert n == N and sizes == [1] * (N - 2) + [2]
        assert steps[f"late-{i}"] > len(sizes)  # but some steps delivered nothing: their delta waited for its values
        whole = {**rep, "score": score, "gate": gate}
        check_against_trace(whole, st.take_traces([f"late-{i}"])[f"late-{i}"], N)


# ---- over HTTP (dynsteer serve, multi-process engine) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with dynsteer_served(tiny_llama_path, log, KEY, {"max_gates": 2}, max_num_seqs=8) as url:
        yield url, str(tiny_llama_path)


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def traced(engine):
    """The in-process engine's traces of each prompt under the module's policy (the same requests as over HTTP)."""
    llm, st = engine
    outs = st.generate(PROMPTS, greedy(), policy=policy(st.hidden_size), report="tokens")
    return [(o.trace, list(o.outputs[0].token_ids), o.outputs[0].dynsteer) for o in outs]


def xargs(hidden: int = 128, report: str | None = "tokens") -> dict:
    return {"vllm_xargs": {"dynsteer": dynsteer.encode_payload(policy=policy(hidden), report=report)}}


def field(choice) -> dict | None:
    return (choice.model_extra or {}).get("dynsteer")


def test_completions_report_equals_the_trace_over_http(server, client, traced):
    _, model = server
    for prompt, (trace, ids, in_process) in zip(PROMPTS, traced):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0,
                                        extra_body={**xargs(), "return_token_ids": True})
        choice = out.choices[0]
        assert choice.model_extra["token_ids"] == ids  # the same request as in process
        check_against_trace(field(choice), trace, N)
        assert field(choice) == in_process


def test_streamed_chunks_carry_exactly_their_tokens_values(server, client):
    _, model = server
    for prompt in PROMPTS:
        full = client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0,
                                         extra_body={**xargs(), "return_token_ids": True})
        chunks = [c for c in client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0,
                                                        stream=True, extra_body={**xargs(), "return_token_ids": True})
                  if c.choices]
        score, gate, ids, last = [], [], [], None
        for c in chunks:
            rep, toks = field(c.choices[0]), c.choices[0].model_extra.get("token_ids") or []
            if rep is None:
                assert not toks
                continue
            assert len(rep["score"]) == len(rep["gate"]) == len(toks)  # exactly the tokens it delivers
            score += rep["score"]
            gate += rep["gate"]
            ids += toks
            last = rep
        want = field(full.choices[0])
        assert ids == full.choices[0].model_extra["token_ids"]
        assert score == want["score"] and gate == want["gate"] and last["summary"] == want["summary"]


def test_summary_over_http_and_requests_without_a_report(server, client, traced):
    _, model = server
    for prompt, (trace, ids, _) in zip(PROMPTS, traced):
        plain = client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0,
                                          extra_body={**xargs(report=None), "return_token_ids": True})
        summ = client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0,
                                         extra_body={**xargs(report="summary"), "return_token_ids": True})
        assert field(plain.choices[0]) is None and "dynsteer" not in plain.choices[0].model_extra
        assert plain.choices[0].text == summ.choices[0].text and plain.choices[0].model_extra["token_ids"] == ids
        rep = field(summ.choices[0])
        assert set(rep) == {"report", "summary"}
        check_summary(rep["summary"], trace)
        stream = [c for c in client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0,
                                                        stream=True, extra_body=xargs(report=None)) if c.choices]
        assert all(field(c.choices[0]) is None for c in stream)
        assert "".join(c.choices[0].text for c in stream) == plain.choices[0].text


def test_chat_completions_report(server, client):
    _, model = server
    msgs = [{"role": "user", "content": "tell me a story"}]
    full = client.chat.completions.create(model=model, messages=msgs, max_tokens=N, temperature=0,
                                          logprobs=True, extra_body=xargs())
    rep = field(full.choices[0])
    n = len(full.choices[0].logprobs.content)
    assert rep["report"] == "tokens" and len(rep["score"]) == len(rep["gate"]) == n and rep["score"][0] is None
    assert rep["summary"]["acted"] == any(g is not None and g[0] != 0 for g in rep["gate"])
    score, gate = [], []
    for c in client.chat.completions.create(model=model, messages=msgs, max_tokens=N, temperature=0, logprobs=True,
                                            stream=True, extra_body=xargs()):
        if not c.choices:
            continue
        r, lp = field(c.choices[0]), c.choices[0].logprobs
        toks = len(lp.content) if lp is not None and lp.content else 0
        if r is None:
            assert toks == 0
            continue
        assert len(r["score"]) == toks
        score += r["score"]
        gate += r["gate"]
    assert score == rep["score"] and gate == rep["gate"]
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=N, temperature=0,
                                           extra_body=xargs(report=None))
    assert field(plain.choices[0]) is None and plain.choices[0].message.content == full.choices[0].message.content


def test_several_samples_each_carry_their_own_report(server, client):
    _, model = server
    body = {**xargs(), "return_token_ids": True, "ignore_eos": True}
    full = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0.8, n=2, seed=1,
                                     extra_body=body)
    for choice in full.choices:
        rep = field(choice)
        assert rep is not None and len(rep["score"]) == len(choice.model_extra["token_ids"]) == N
        assert rep["score"][0] is None and all(s is not None for s in rep["score"][1:])
    counts = {0: 0, 1: 0}
    for c in client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=0.8, n=2, seed=1,
                                       stream=True, extra_body=body):
        for choice in c.choices:
            rep, toks = field(choice), choice.model_extra.get("token_ids") or []
            assert (rep is None and not toks) or len(rep["score"]) == len(toks)
            counts[choice.index] += len(toks)
            if choice.finish_reason is not None:
                assert "summary" in rep
    assert counts == {0: N, 1: N}
