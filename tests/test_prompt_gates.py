"""Prompt-level (CAST-style) gates through a real vLLM engine (tiny Llama): decided once from the prompt's last token
inside the forward pass, held for the whole generation, combined with per-token gates as a rule's condition."""

from __future__ import annotations

import numpy as np
import pytest

import dynsteer
from dynsteer import (Action, AddVector, CaptureSpec, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule,
                      SteeringSpec)
from tests.conftest import ON_GPU, make_llm, token_ids, unit, vec

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning", "she opened the door and",
           "a long time ago", "it was the best of times"]
MON_LAYER, ACT_LAYER = 2, 1  # the action sits *before* the monitor: a held prompt gate exists before any layer
TOL = 5e-2 if ON_GPU else 1e-6
N = 12


def greedy(n: int = N):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    cfg = DynsteerConfig(capture_sites=("post_block",), capture_layers=(MON_LAYER,), max_gates=4)
    # 16-token blocks with prefix caching: long prompts are cached, which the prompt-mean test relies on
    with make_llm(tiny_llama_path, enable_prefix_caching=True, block_size=16, **cfg.engine_kwargs()) as llm:
        yield llm, dynsteer.attach(llm)


@pytest.fixture(autouse=True)
def _clean(engine):
    yield
    engine[1].clear_all()
    engine[1].clear_policy()


def prompt_monitor(h: int, threshold: float, sharpness: float = 2.0, name: str = "topic") -> ProbeGate:
    return ProbeGate(name=name, layer=MON_LAYER, direction=unit(h, 0), sharpness=sharpness, threshold=threshold,
                   reads="prompt_last")


def last_prompt_scores(st, prompts) -> np.ndarray:
    outs = st.generate(prompts, greedy(2), capture=CaptureSpec(sites=["post_block"], layers=[MON_LAYER],
                                                               positions="last_prompt"))
    x = np.stack([o.capture[(MON_LAYER, "post_block")][0].astype(np.float64) for o in outs])
    return x @ unit(st.hidden_size, 0).astype(np.float64)


def test_held_gate_equals_the_probe_on_the_last_prompt_token(engine):
    llm, st = engine
    h = st.hidden_size
    scores = last_prompt_scores(st, PROMPTS)
    thr = float(np.median(scores))  # about half the prompts on each side
    pol = DynamicSteeringPolicy(monitors=[prompt_monitor(h, thr)], rules=[
        Rule(monitor="topic", actions=[Action(kind="add", layer=ACT_LAYER, vector=vec(h, 1))])])
    outs = st.generate(PROMPTS, greedy(), policy=pol)
    want = 1 / (1 + np.exp(-2.0 * (scores - thr)))
    for out, g in zip(outs, want):
        tr = out.trace
        assert tr is not None and len(tr) == N - 1
        applied = tr.applied_gates(0)
        assert np.all(applied == applied[0])  # held: one decision for every generated token
        assert abs(applied[0] - g) <= TOL, (applied[0], g)
        assert np.all(np.isnan(tr.scores(0)))
        np.testing.assert_array_equal(tr.gates(0), applied)  # no per-token score: the prompt decided


def test_prompt_gate_steers_whole_requests_or_leaves_them_byte_identical(engine):
    llm, st = engine
    h = st.hidden_size
    base = token_ids(llm.generate(PROMPTS, greedy()))
    static = token_ids(st.generate(PROMPTS, greedy(), steering=SteeringSpec(vectors=[
        AddVector(layer=ACT_LAYER, vector=vec(h, 1), tier="decode")])))
    scores = last_prompt_scores(st, PROMPTS)
    thr = float(np.median(scores))
    # sharp gate with a floor: accepted prompts get a gate of exactly 1, the others exactly 0
    pol = DynamicSteeringPolicy(monitors=[prompt_monitor(h, thr, sharpness=1e6)], rules=[
        Rule(monitor="topic", gate_floor=0.5, actions=[Action(kind="add", layer=ACT_LAYER, vector=vec(h, 1))])])
    got = token_ids(st.generate(PROMPTS, greedy(), policy=pol))
    accepted = scores > thr
    assert 0 < accepted.sum() < len(PROMPTS)
    for i in range(len(PROMPTS)):
        assert got[i] == (static[i] if accepted[i] else base[i]), i
    assert token_ids(llm.generate(PROMPTS, greedy())) == base  # nothing left behind


def test_condition_multiplies_a_per_token_gate(engine):
    llm, st = engine
    h = st.hidden_size
    base = token_ids(llm.generate(PROMPTS, greedy()))
    scores = last_prompt_scores(st, PROMPTS)
    thr = float(np.median(scores))
    act = Action(kind="add", layer=MON_LAYER + 1, vector=vec(h, 2))
    tok = ProbeGate(name="tok", layer=MON_LAYER, direction=unit(h, 3), sharpness=1.0, threshold=-1e9)  # always 1
    plain = DynamicSteeringPolicy(monitors=[tok], rules=[Rule(monitor="tok", actions=[act])])
    cond = DynamicSteeringPolicy(monitors=[tok, prompt_monitor(h, thr, sharpness=1e6)],
                                 rules=[Rule(monitor="tok", actions=[act], condition="topic")])
    always = token_ids(st.generate(PROMPTS, greedy(), policy=plain))
    outs = st.generate(PROMPTS, greedy(), policy=cond)
    got = token_ids(outs)
    for i, accepted in enumerate(scores > thr):
        assert got[i] == (always[i] if accepted else base[i]), i
        tr = outs[i].trace
        assert np.all(tr.applied_gates(0) == (1.0 if accepted else 0.0))  # the rule's gate: token gate × condition
        assert np.all(tr.applied_gates(1) == (1.0 if accepted else 0.0))  # the condition's own slot: its held gate


def test_mixed_batch_with_plain_and_prompt_level_policies(engine):
    llm, st = engine
    h = st.hidden_size
    base = token_ids(llm.generate(PROMPTS, greedy()))
    never = DynamicSteeringPolicy(monitors=[prompt_monitor(h, 1e9)], rules=[
        Rule(monitor="topic", actions=[Action(kind="add", layer=ACT_LAYER, vector=vec(h, 1))])])
    ever = DynamicSteeringPolicy(monitors=[prompt_monitor(h, -1e9)], rules=[
        Rule(monitor="topic", actions=[Action(kind="add", layer=ACT_LAYER, vector=vec(h, 1))])])
    static = token_ids(st.generate(PROMPTS, greedy(), steering=SteeringSpec(vectors=[
        AddVector(layer=ACT_LAYER, vector=vec(h, 1), tier="decode")])))
    got = token_ids(st.generate(PROMPTS, greedy(), policy=[never, ever, None, ever, never, None]))
    assert [got[i] == base[i] for i in (0, 2, 4, 5)] == [True] * 4
    assert got[1] == static[1] and got[3] == static[3]


@pytest.mark.parametrize("build, field", [
    (lambda m, a: DynamicSteeringPolicy(monitors=[m], rules=[Rule(monitor="topic", actions=[a],
                                                                  scope="rest_of_request")]), "rules[0].scope"),
    (lambda m, a: DynamicSteeringPolicy(monitors=[m], rules=[Rule(monitor="topic", abort="no")]), "rules[0].abort"),
    (lambda m, a: DynamicSteeringPolicy(monitors=[m.model_copy(update={"reads": "token"}), m.model_copy(
        update={"name": "t2"})], rules=[Rule(monitor="t2", actions=[a], condition="topic")]), "rules[0].condition"),
    (lambda m, a: DynamicSteeringPolicy(monitors=[m], rules=[Rule(monitor="topic", actions=[a], condition="nope")]),
     "rules[0].condition"),
])
def test_bad_prompt_level_policies_name_the_field(build, field):
    m = ProbeGate(name="topic", layer=1, direction=[1.0, 0.0], sharpness=1.0, threshold=0.0, reads="prompt_last")
    a = Action(kind="add", layer=0, vector=[0.0, 1.0])
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        build(m, a)


def test_unknown_read_mode_is_rejected():
    with pytest.raises(ValueError, match="reads"):
        ProbeGate(name="m", layer=1, direction=[1.0, 0.0], sharpness=1.0, threshold=0.0, reads="prompt_everything")


def test_prompt_mean_gate_equals_the_probe_on_the_mean_prompt_residual_and_ignores_the_cache(engine):
    llm, st = engine
    h = st.hidden_size
    prompts = [" ".join([p] * 8) for p in PROMPTS]  # several KV blocks each: cacheable
    outs = st.generate(prompts, greedy(2), capture=CaptureSpec(sites=["post_block"], layers=[MON_LAYER],
                                                               positions="all_prompt"))
    means = np.array([o.capture[(MON_LAYER, "post_block")].astype(np.float64).mean(0) @ unit(h, 0) for o in outs])
    assert all(len(o.capture.positions) == len(o.prompt_token_ids) for o in outs)
    thr = float(np.median(means))
    mon = prompt_monitor(h, thr).model_copy(update={"reads": "prompt_mean"})
    pol = DynamicSteeringPolicy(monitors=[mon], rules=[
        Rule(monitor="topic", actions=[Action(kind="add", layer=ACT_LAYER, vector=vec(h, 1))])])
    want = 1 / (1 + np.exp(-2.0 * (means - thr)))
    assert min(len(o.prompt_token_ids) for o in outs) >= 32
    llm.generate(prompts, greedy(2))  # every prompt's blocks are cached now: the mean must not start from them
    for _ in range(2):
        got = st.generate(prompts, greedy(), policy=pol)
        for out, g in zip(got, want):
            applied = out.trace.applied_gates(0)
            assert np.all(applied == applied[0]) and abs(applied[0] - g) <= TOL, (applied[0], g)
    # and it differs from the last token's decision for some prompt (it is not the last-token gate in disguise)
    last = st.generate(prompts, greedy(), policy=pol.model_copy(update={"monitors": (
        prompt_monitor(h, thr),)}))
    assert any(abs(a.trace.applied_gates(0)[0] - b.trace.applied_gates(0)[0]) > 1e-3 for a, b in zip(got, last))


@pytest.mark.parametrize("reads", ["prompt_last", "prompt_mean"])
def test_preempted_requests_keep_their_prompt_decision(tiny_llama_path, reads):
    """A KV cache too small for the batch forces preemptions: a resumed request recomputes its prompt (and, for the
    mean, sums no position twice) yet keeps the decision it took, so outputs and held gates equal an unpreempted
    run. Engines of its own: last in the module."""
    from vllm import SamplingParams

    prompts = [f"{p} and then" for p in PROMPTS[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    cfg = DynsteerConfig(max_gates=2)
    runs = {}
    for name, extra in (("roomy", {}), ("tight", {"num_gpu_blocks_override": 8, "block_size": 32})):
        with make_llm(tiny_llama_path, disable_log_stats=False, **extra, **cfg.engine_kwargs()) as llm:
            st = dynsteer.attach(llm)
            h = st.hidden_size
            pols = [DynamicSteeringPolicy(monitors=[ProbeGate(
                name="topic", layer=MON_LAYER, direction=unit(h, 0), sharpness=0.5, threshold=thr, reads=reads)],
                rules=[Rule(monitor="topic", actions=[Action(kind="add", layer=ACT_LAYER, vector=vec(h, 1))])])
                for thr in (-1.0, 0.0, 1.0, 2.0)]
            runs[name] = st.generate(prompts, params, policy=pols)
            if name == "tight":
                assert sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") > 0
    for roomy, tight in zip(runs["roomy"], runs["tight"]):
        assert token_ids([tight]) == token_ids([roomy])
        assert tight.trace.position == roomy.trace.position
        np.testing.assert_allclose(tight.trace.applied_gates(0), roomy.trace.applied_gates(0), atol=1e-6)
        assert 0.0 < roomy.trace.applied_gates(0)[0] < 1.0  # a real decision, not a saturated one
