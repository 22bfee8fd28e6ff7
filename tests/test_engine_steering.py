"""Static steering through a real vLLM engine (CPU, tiny Llama): outputs, restoration, batches, tiers, clamps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dynsteer
from dynsteer import Ablation, AddVector, ProjectionClamp, SteeringSpec, SteeringValidationError
from tests.conftest import make_llm, needs_eager_hooks, token_ids

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning", "she opened the door and"]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with make_llm(tiny_llama_path) as llm:
        yield llm, dynsteer.attach(llm)


@pytest.fixture(autouse=True)
def _clean(engine):
    yield
    engine[1].clear_all()


def greedy(n: int = 12, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def rand_vec(steerer, seed: int, scale: float = 4.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(steerer.hidden_size) * scale).astype(np.float32)


def test_steering_changes_output_and_clearing_restores_baseline_exactly(engine):
    llm, st = engine
    base = token_ids(llm.generate(PROMPTS, greedy()))
    for site in dynsteer.SITES:
        st.set_layer_vector(1, rand_vec(st, 0), site=site)
        steered = token_ids(llm.generate(PROMPTS, greedy()))
        assert steered != base, site
        st.clear_layer_vector(1)
        assert token_ids(llm.generate(PROMPTS, greedy())) == base, site


def test_context_manager_restores_previous_spec_even_on_error(engine):
    llm, st = engine
    outer = SteeringSpec(vectors=[AddVector(layer=0, vector=rand_vec(st, 1))])
    st.apply_steering_spec(outer)
    with pytest.raises(RuntimeError):
        with st.steering(SteeringSpec(vectors=[AddVector(layer=2, vector=rand_vec(st, 2))])):
            assert st.export_steering_spec().vectors[0].layer == 2
            raise RuntimeError("boom")
    assert st.export_steering_spec() == outer


def test_mixed_batch_rows_equal_their_solo_runs(engine):
    llm, st = engine
    spec_a = SteeringSpec(vectors=[AddVector(layer=1, vector=rand_vec(st, 3))])
    spec_b = SteeringSpec(vectors=[AddVector(layer=2, site="pre_attn", vector=rand_vec(st, 4))])
    base = token_ids(llm.generate(PROMPTS, greedy()))
    solo_a = token_ids(st.generate(PROMPTS[0], greedy(), steering=[spec_a]))
    solo_b = token_ids(st.generate(PROMPTS[1], greedy(), steering=[spec_b]))
    mixed = token_ids(st.generate(PROMPTS, greedy(), steering=[spec_a, spec_b, None, None]))
    assert mixed[0] == solo_a[0] != base[0]
    assert mixed[1] == solo_b[0] != base[1]
    assert mixed[2:] == base[2:]  # unsteered rows byte-identical to the unsteered-only run


def test_per_request_steering_on_top_of_global(engine):
    llm, st = engine
    g = rand_vec(st, 5)
    r = rand_vec(st, 6)
    both = SteeringSpec(vectors=[AddVector(layer=1, vector=g), AddVector(layer=2, vector=r)])
    expected = token_ids(st.generate(PROMPTS[:1], greedy(), steering=both))
    st.set_layer_vector(1, g)
    got = token_ids(st.generate(PROMPTS[:1], greedy(), steering=SteeringSpec(vectors=[AddVector(layer=2, vector=r)])))
    assert got == expected


def test_named_vectors_are_referenced_by_name(engine):
    llm, st = engine
    v = rand_vec(st, 7)
    inline = token_ids(st.generate(PROMPTS[:2], greedy(), steering=SteeringSpec(vectors=[AddVector(layer=1, vector=v)])))
    st.register_vector("concept", v)
    named = token_ids(st.generate(PROMPTS[:2], greedy(),
                                  steering=SteeringSpec(vectors=[AddVector(layer=1, vector="concept")])))
    assert named == inline != token_ids(llm.generate(PROMPTS[:2], greedy()))


def first_token_logprobs(outputs) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outputs]


def test_decode_only_steering_leaves_first_token_logits_unchanged(engine):
    llm, st = engine
    params = greedy(8, logprobs=10)
    base = llm.generate(PROMPTS, params)
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector=rand_vec(st, 8), tier="decode")])
    steered = st.generate(PROMPTS, params, steering=spec)
    assert first_token_logprobs(steered) == first_token_logprobs(base)
    assert token_ids(steered) != token_ids(base)  # later (generated) tokens are steered


def test_prefill_only_steering_changes_the_prompt_kv(engine):
    """With prefill-only steering the decode steps are unsteered, so a changed distribution for the second
    token after an identical first token can only come from the prompt's KV."""
    llm, st = engine
    params = greedy(2, logprobs=10)
    base = llm.generate(PROMPTS, params)
    v = rand_vec(st, 9, scale=1.0)
    for scale in (0.02, 0.05, 0.1, 0.3, 1.0):
        spec = SteeringSpec(vectors=[AddVector(layer=0, vector=v, scale=scale, tier="prefill")])
        out = st.generate(PROMPTS, params, steering=spec)
        for o, b in zip(out, base):
            if o.outputs[0].token_ids[0] != b.outputs[0].token_ids[0]:
                continue
            second = {t: lp.logprob for t, lp in o.outputs[0].logprobs[1].items()}
            second_base = {t: lp.logprob for t, lp in b.outputs[0].logprobs[1].items()}
            if second != second_base:
                return
    pytest.fail("prefill-only steering never changed the next step's distribution after the same first token")


def _site_residual_recorder(layer_idx: int, site: str, store: list):
    """Forward hooks (eager engine) that record the residual stream just after ``site`` in ``layer_idx``."""

    def install(model):
        layer = next(m for name, m in model.named_modules() if name.endswith(f"layers.{layer_idx}"))
        if site == "post_block":
            h = layer.register_forward_hook(lambda m, i, o: store.append((o[0] + o[1]).detach().clone()))
        elif site == "post_attn":
            h = layer.post_attention_layernorm.register_forward_hook(
                lambda m, i, o: store.append(o[1].detach().clone()))
        else:
            h = layer.input_layernorm.register_forward_hook(lambda m, i, o: store.append(o[1].detach().clone()))
        return h

    return install


@needs_eager_hooks
@pytest.mark.parametrize("site", dynsteer.SITES)
def test_clamp_and_ablation_bound_the_projection(engine, site):
    llm, st = engine
    layer = 2
    u = rand_vec(st, 10, 1.0)
    u_hat = torch.from_numpy(u / np.linalg.norm(u))
    store: list[torch.Tensor] = []
    handles = llm.apply_model(_site_residual_recorder(layer, site, store))

    def projections(spec) -> torch.Tensor:
        store.clear()
        st.generate(PROMPTS, greedy(6), steering=spec)
        return torch.cat([x.float() @ u_hat for x in store])

    free = projections(None)
    assert free.max() > 0.5 and free.min() < -0.5  # the direction is actually used, so clamps have work to do
    clamped = projections(SteeringSpec(clamps=[ProjectionClamp(layer=layer, site=site, direction=u, lo=-0.5,
                                                               hi=0.5)]))
    assert clamped.min() >= -0.5 - 1e-4 and clamped.max() <= 0.5 + 1e-4
    ablated = projections(SteeringSpec(ablations=[Ablation(layer=layer, site=site, direction=u)]))
    assert ablated.abs().max() < 1e-4
    for h in handles:
        h.remove()


def test_bad_requests_are_rejected_and_requests_in_flight_finish_unchanged(engine):
    llm, st = engine
    base = token_ids(llm.generate(PROMPTS[:2], greedy()))
    engine_ = llm.llm_engine
    bad_payloads = {
        "hidden": SteeringSpec(vectors=[AddVector(layer=0, vector=np.ones(st.hidden_size + 3, np.float32))]),
        "layer": SteeringSpec(vectors=[AddVector(layer=st.num_layers, vector=rand_vec(st, 1))]),
        "nan": SteeringSpec(vectors=[AddVector(layer=0, vector=np.full(st.hidden_size, np.nan, np.float32))]),
        "name": SteeringSpec(vectors=[AddVector(layer=0, vector="never-registered")]),
    }
    engine_.add_request("good-0", PROMPTS[0], greedy())
    engine_.step()  # the good requests are in flight when the bad ones arrive
    engine_.add_request("good-1", PROMPTS[1], greedy())
    for key, spec in bad_payloads.items():
        with pytest.raises(SteeringValidationError, match="extra_args.dynsteer.spec.vectors\\[0\\]"):
            engine_.add_request(f"bad-{key}", PROMPTS[2], dynsteer.steer_params(greedy(), spec))
    for raw, match in (("ds1:@@@", "malformed packed payload"), ({"spec": {"vectors": [{"layer": 0}]}}, "vector"),
                       ({"spec": {"vectors": [{"layer": 0, "site": "mlp", "vector": [0.0]}]}}, "site")):
        params = greedy()
        params.extra_args = {"dynsteer": raw}
        with pytest.raises(SteeringValidationError, match=match):
            engine_.add_request("bad-raw", PROMPTS[2], params)
    done = {}
    while engine_.has_unfinished_requests():
        for out in engine_.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert [done["good-0"], done["good-1"]] == base
    with pytest.raises(SteeringValidationError, match="global.vectors\\[0\\].vector"):
        st.set_layer_vector(0, np.ones(st.hidden_size + 1))
    assert st.export_steering_spec().is_empty()


def test_re_registering_a_name_takes_effect_for_new_requests(engine):
    llm, st = engine
    a, b = rand_vec(st, 11), rand_vec(st, 12)
    by_name = SteeringSpec(vectors=[AddVector(layer=1, vector="swap")])
    st.register_vector("swap", a)
    first = token_ids(st.generate(PROMPTS[:2], greedy(), steering=by_name))
    st.register_vector("swap", b)
    second = token_ids(st.generate(PROMPTS[:2], greedy(), steering=by_name))
    inline_b = token_ids(st.generate(PROMPTS[:2], greedy(), steering=SteeringSpec(vectors=[AddVector(layer=1, vector=b)])))
    assert second == inline_b != first
