"""Dynamic steering through a real vLLM engine (tiny Llama): in-graph gates, scopes, sync controllers, traces, APC.

Tests that build their own engines come last: tearing one down resets vLLM's process-wide parallel state, which the
module's shared engine still uses.
"""

from __future__ import annotations

import numpy as np
import pytest

import dynsteer
from dynsteer import (Action, AddVector, CaptureSpec, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule,
                      SteeringSpec, SteeringValidationError, SyncControllerSpec)
from dynsteer.controllers.sync import applied_scales, make_controller
from tests.conftest import ON_GPU, make_llm, token_ids, unit, vec

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning", "she opened the door and"]
MON_LAYER, ACT_LAYER = 1, 2
# Gate tolerance: float32 on CPU; bf16 residuals on GPU move scores by ~1e-2 relative.
TOL = 5e-2 if ON_GPU else 1e-4


def greedy(n: int = 16):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    cfg = DynsteerConfig(capture_sites=("post_block",), capture_layers=(MON_LAYER,), max_gates=3,
                         controllers={"every_other": "dynsteer.testing.controllers:EveryOther"})
    with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
        yield llm, dynsteer.attach(llm)


@pytest.fixture(autouse=True)
def _clean(engine):
    yield
    engine[1].clear_all()
    engine[1].clear_policy()


def policy(st, threshold: float, *, scope: str = "this_token", sharpness: float = 4.0, floor: float = 0.0,
           controller: SyncControllerSpec | None = None, action_scale: float = 1.0) -> DynamicSteeringPolicy:
    mon = ProbeGate(name="m", layer=MON_LAYER, direction=unit(st.hidden_size, 0), sharpness=sharpness,
                  threshold=threshold)
    act = Action(kind="add", layer=ACT_LAYER, vector=vec(st.hidden_size, 1), scale=action_scale)
    return DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act], scope=scope,
                                                             gate_floor=floor)], controller=controller)


ALWAYS, NEVER = -1e9, 1e9  # thresholds whose float32 sigmoid is exactly 1 / exactly 0


def test_gate_trace_equals_probe_on_captured_residuals(engine):
    llm, st = engine
    pol = policy(st, threshold=0.0, sharpness=2.0)
    outs = st.generate(PROMPTS, greedy(), policy=pol,
                       capture=CaptureSpec(sites=["post_block"], layers=[MON_LAYER], positions="all_generated"))
    p = unit(st.hidden_size, 0).astype(np.float64)
    for out in outs:
        tr, cap = out.trace, out.capture
        assert tr is not None and len(tr) == 15  # 16 generated tokens; the last one is never fed back
        positions, resid = cap.positions, cap[(MON_LAYER, "post_block")]
        by_pos = dict(zip(positions.tolist(), resid.astype(np.float64)))
        x = np.stack([by_pos[q] for q in tr.position])
        np.testing.assert_allclose(tr.scores(), x @ p, rtol=TOL, atol=TOL)
        np.testing.assert_allclose(tr.gates(), 1 / (1 + np.exp(-2.0 * (x @ p))), atol=TOL)
        np.testing.assert_allclose(tr.applied_gates(), tr.gates(), atol=1e-6)  # this_token, no controller
        assert tr.position == list(range(len(out.prompt_token_ids), len(out.prompt_token_ids) + 15))


def test_open_gate_equals_static_decode_tier_and_closed_gate_is_byte_identical(engine):
    llm, st = engine
    base = token_ids(llm.generate(PROMPTS, greedy()))
    static = token_ids(st.generate(PROMPTS, greedy(), steering=SteeringSpec(vectors=[
        AddVector(layer=ACT_LAYER, vector=vec(st.hidden_size, 1), tier="decode")])))
    assert static != base
    # one continuous batch: open gate, closed gate, no policy, open gate
    mixed = st.generate(PROMPTS, greedy(), policy=[policy(st, ALWAYS), policy(st, NEVER), None, policy(st, ALWAYS)])
    got = token_ids(mixed)
    # A gate of exactly 1 on every generated token and 0 on the prompt is the static decode tier: prompts are
    # never gated, and the gate acts on the very token it was computed for.
    assert got[0] == static[0] and got[3] == static[3]
    assert got[1] == base[1] and got[2] == base[2]
    assert mixed[2].trace is None and np.all(mixed[1].trace.applied_gates() == 0)
    assert np.all(mixed[0].trace.applied_gates() == 1)
    assert token_ids(llm.generate(PROMPTS, greedy())) == base  # nothing left behind


def test_gate_floor_zeroes_weak_gates_exactly(engine):
    llm, st = engine
    base = token_ids(llm.generate(PROMPTS, greedy()))
    # threshold far above the scores (|score| < 50 here): gates are small but non-zero, and move the output
    # without the floor
    weak = policy(st, threshold=80.0, sharpness=0.1, action_scale=50.0)
    outs = st.generate(PROMPTS, greedy(), policy=weak)
    assert token_ids(outs) != base
    assert all(0 < o.trace.gates().max() < 0.05 for o in outs)
    floored = policy(st, threshold=80.0, sharpness=0.1, action_scale=50.0, floor=0.5)
    outs = st.generate(PROMPTS, greedy(), policy=floored)
    assert token_ids(outs) == base
    assert all(np.all(o.trace.gates() == 0) for o in outs)


def test_next_step_scope_lags_one_token(engine):
    llm, st = engine
    base = token_ids(llm.generate(PROMPTS, greedy()))
    outs = st.generate(PROMPTS, greedy(), policy=policy(st, ALWAYS, scope="next_step"))
    for o, b in zip(outs, base):
        assert o.trace.applied_gates().tolist() == [0.0] + [1.0] * 14
        got = list(o.outputs[0].token_ids)
        assert got[:2] == b[:2] and got != b  # token 2 comes from the first ungated decode step


def test_rest_of_request_latches_after_first_fire(engine):
    llm, st = engine
    probe_run = st.generate(PROMPTS, greedy(), policy=policy(st, NEVER, sharpness=1.0))
    scores = probe_run[0].trace.scores()
    k = 3 + int(np.argmax(scores[3:10]))
    if np.any(scores[:k] >= scores[k]):
        pytest.skip("no clean first crossing in this prompt's scores")
    thr = float((scores[k] + scores[:k].max()) / 2)  # midway: robust to bf16 noise between batch shapes
    pol = policy(st, thr, scope="rest_of_request", sharpness=1e4)
    tr = st.generate(PROMPTS[:1], greedy(), policy=pol)[0].trace
    applied = tr.applied_gates()
    assert np.all(applied[:k] < 1e-3) and applied[k] > 0.5
    assert np.all(applied[k + 1:] == 1.0)  # stays on even where the gate falls back
    np.testing.assert_allclose(tr.scores()[:k + 1], scores[:k + 1], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("ctrl", [
    SyncControllerSpec(kind="latch", on=0.0, off=-0.5, scale=2.0),
    SyncControllerSpec(kind="ema_latch", alpha=0.5, on=0.0, off=-0.5, scale=1.5),
    SyncControllerSpec(kind="pid", target=0.0, kp=0.8, ki=0.2, kd=0.1, max_scale=2.0),
    SyncControllerSpec(kind="budget", max_steered_tokens=3,
                       inner=SyncControllerSpec(kind="latch", on=-10.0, off=-10.0, scale=1.0)),
], ids=["latch", "ema", "pid", "budget"])
def test_controllers_in_the_engine_replay_offline(engine, ctrl):
    llm, st = engine
    outs = st.generate(PROMPTS, greedy(), policy=policy(st, ALWAYS, controller=ctrl))
    for o in outs:
        tr = o.trace
        want = applied_scales(make_controller(ctrl), tr.scores().tolist(), gates=tr.gates().tolist())
        np.testing.assert_allclose(tr.scale, want, atol=1e-6)
        np.testing.assert_allclose(tr.applied_gates(), want, atol=1e-6)  # gate 1 × dyn_scale
    if ctrl.kind == "budget":
        assert all(sum(s != 0 for s in o.trace.scale) == 3 for o in outs)


def test_sync_controller_latency_is_exactly_one_step(engine):
    llm, st = engine
    base_run = st.generate(PROMPTS[:1], greedy(24), policy=policy(st, NEVER))[0]
    base, scores = list(base_run.outputs[0].token_ids), base_run.trace.scores()
    k = 2 + int(np.argmax(scores[2:12]))
    if np.any(scores[:k] >= scores[k]):
        pytest.skip("no clean first crossing")
    on = float((scores[k] + scores[:k].max()) / 2)
    latch = SyncControllerSpec(kind="latch", on=on, off=-1e9, scale=1.0)
    run = st.generate(PROMPTS[:1], greedy(24), policy=policy(st, ALWAYS, controller=latch))[0]
    scale = np.asarray(run.trace.scale)
    assert np.all(scale[:k + 1] == 0) and np.all(scale[k + 1:] == 1.0)  # triggered at step k, acts at k + 1
    got = list(run.outputs[0].token_ids)
    # step j's forward yields generated token j + 1: tokens 0..k+1 are unsteered, token k + 2 is the first steered
    assert got[:k + 2] == base[:k + 2] and got != base


def test_global_policy_and_clearing_restores_baseline(engine):
    llm, st = engine
    base = token_ids(llm.generate(PROMPTS, greedy()))
    st.set_policy(policy(st, ALWAYS))
    outs = st.generate(PROMPTS, greedy())
    assert token_ids(outs) != base and all(o.trace is not None for o in outs)
    # a request's own policy overrides the global one
    own = st.generate(PROMPTS[:1], greedy(), policy=policy(st, NEVER))
    assert token_ids(own)[0] == base[0]
    st.clear_policy()
    assert token_ids(llm.generate(PROMPTS, greedy())) == base
    info = st.describe()[0]["dynamic"]
    assert info["live"] == 0 and info["global_policy"] is False


def test_bad_policies_are_rejected_naming_the_field_and_others_run(engine):
    llm, st = engine
    h = st.hidden_size
    good = policy(st, ALWAYS)
    bad_dir = good.model_copy(update={"monitors": (good.monitors[0].model_copy(
        update={"direction": np.ones(h + 1, np.float32)}),)})
    with pytest.raises(SteeringValidationError, match=r"policy\.monitors\[0\]\.direction"):
        st.generate(PROMPTS[:1], greedy(), policy=bad_dir)
    many = DynamicSteeringPolicy(monitors=good.monitors, rules=[good.rules[0]] * 4)
    with pytest.raises(SteeringValidationError, match=r"policy\.rules.*max_gates"):
        st.generate(PROMPTS[:1], greedy(), policy=many)
    with pytest.raises(SteeringValidationError, match=r"global_policy\.rules\[0\]\.actions\[0\]\.layer"):
        st.set_policy(DynamicSteeringPolicy(monitors=good.monitors, rules=[Rule(monitor="m", actions=[
            Action(kind="add", layer=9, vector=vec(h, 1))])]))
    assert st.export_policy() is None
    outs = st.generate(PROMPTS, greedy(), policy=good)
    assert all(np.all(o.trace.applied_gates() == 1) for o in outs)



def test_user_controller_plugs_in_by_registered_name(engine):
    llm, st = engine
    ctrl = SyncControllerSpec(kind="custom", name="every_other", options={"scale": 2.0})
    tr = st.generate(PROMPTS[:1], greedy(), policy=policy(st, ALWAYS, controller=ctrl))[0].trace
    assert tr.scale == ([0.0] + [2.0, 0.0] * 7)[:len(tr)]
    with pytest.raises(ValueError, match="factory: import paths are not accepted"):
        SyncControllerSpec(kind="custom", factory="tests.test_dynamic:EveryOther")
    with pytest.raises(SteeringValidationError, match=r"policy\.controller\.name: unknown controller 'nope'"):
        st.generate(PROMPTS[:1], greedy(), policy=policy(st, ALWAYS, controller=SyncControllerSpec(
            kind="custom", name="nope")))


def test_an_abort_rule_stops_its_request_where_its_monitor_fires_and_nothing_else(engine):
    """A rule with ``abort`` (no actions) steers nothing: its request's tokens equal an unsteered run's up to where
    its monitor first crosses the threshold, then it finishes (within two steps) with the rule's reason; a rule
    that never fires runs to the end byte-identical; a request without a policy in the same batch is untouched."""
    llm, st = engine
    base = st.generate(PROMPTS[:2], greedy(24))
    mon = ProbeGate(name="m", layer=MON_LAYER, direction=unit(st.hidden_size, 0), sharpness=1.0, threshold=NEVER)
    probe = st.generate(PROMPTS[:1], greedy(24), policy=DynamicSteeringPolicy(
        monitors=[mon], rules=[Rule(monitor="m", abort="probe")]))[0]
    assert token_ids([probe]) == token_ids(base[:1])  # an abort rule that never fires changes nothing
    assert probe.outputs[0].finish_reason == "length"
    scores, positions = probe.trace.scores().astype(np.float64).ravel(), np.asarray(probe.trace.position)
    k = 4 + int(np.argmax(scores[4:] - np.maximum.accumulate(scores)[3:-1]))  # a fresh maximum after 4 tokens
    assert scores[k] > scores[:k].max()
    thr = float((scores[k] + scores[:k].max()) / 2)
    pol = DynamicSteeringPolicy(monitors=[mon.model_copy(update={"threshold": thr, "sharpness": 1e4})],
                                rules=[Rule(monitor="m", abort="flagged by the probe")])
    out = st.generate(PROMPTS[:2], greedy(24), policy=[pol, None])
    got, n0 = out[0].outputs[0], len(out[0].prompt_token_ids)
    fired_at = int(positions[k])
    assert got.finish_reason == "abort"
    assert "dynsteer policy: rule 0 (monitor m): flagged by the probe" in str(got.stop_reason)
    assert fired_at - n0 + 1 <= len(got.token_ids) <= fired_at - n0 + 4  # read back within two steps
    assert list(got.token_ids) == token_ids(base[:1])[0][:len(got.token_ids)]
    assert token_ids(out[1:]) == token_ids(base[1:])  # the other request: full length, byte-identical
    with pytest.raises(Exception, match="actions"):
        Rule(monitor="m")  # neither actions nor abort


def test_dynamic_decode_blocks_are_never_reused_by_other_requests(tiny_llama_path):
    """Blocks holding tokens generated under a policy fork the hash chain; prompt blocks keep their hits."""
    from vllm import SamplingParams

    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    follow = SamplingParams(temperature=0.0, max_tokens=8)
    with make_llm(tiny_llama_path, enable_prefix_caching=True, block_size=32,
                  **DynsteerConfig(max_gates=2).engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        pol = policy(st, ALWAYS)
        steered = st.generate([prompt], params, policy=pol)[0]
        continued = {"prompt_token_ids": list(steered.prompt_token_ids) + list(steered.outputs[0].token_ids)}
        cached = token_ids(llm.generate([continued], follow))[0]
    with make_llm(tiny_llama_path, enable_prefix_caching=False, block_size=32,
                  **DynsteerConfig(max_gates=2).engine_kwargs()) as llm:
        truth = token_ids(llm.generate([continued], follow))[0]
    assert cached == truth


def test_preempted_requests_replay_their_dynamic_steering(tiny_llama_path):
    """A KV cache too small for the batch forces preemptions; a resumed request recomputes its generated tokens with
    the gates and controller scales they had, so outputs and traces equal an unpreempted run."""
    from vllm import SamplingParams

    prompts = [f"{p} and then" for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    cfg = DynsteerConfig(max_gates=2)
    runs = {}
    for name, extra in (("roomy", {}), ("tight", {"num_gpu_blocks_override": 8, "block_size": 32})):
        with make_llm(tiny_llama_path, disable_log_stats=False, **extra, **cfg.engine_kwargs()) as llm:
            st = dynsteer.attach(llm)
            pols = [policy(st, 0.0, sharpness=0.5, controller=SyncControllerSpec(
                kind="ema_latch", alpha=0.5, on=0.0, off=-2.0, scale=1.0)),
                policy(st, 0.0, scope="next_step"), policy(st, 0.0, scope="rest_of_request"), policy(st, 0.0)]
            runs[name] = st.generate(prompts, params, policy=pols)
            if name == "tight":
                assert sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") > 0
    for roomy, tight in zip(runs["roomy"], runs["tight"]):
        assert token_ids([tight]) == token_ids([roomy])
        assert tight.trace.position == roomy.trace.position  # each generated position traced once
        assert tight.trace.scale == roomy.trace.scale
        np.testing.assert_allclose(tight.trace.applied_gates(), roomy.trace.applied_gates(), atol=1e-3)

