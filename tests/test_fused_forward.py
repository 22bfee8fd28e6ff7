"""``DynsteerConfig(forward="fused")``: sites run inside the add + RMS norm that follows them, through a real engine.

For Llama and Gemma 2, the same workload (static steering at every site kind in one mixed batch, clamps, a dynamic
policy whose monitor and gated action share one fused kernel, capture at fused places) runs on a ``forward="op"``
engine and a
``forward="fused"`` engine; tokens, gates and captured residuals must agree, and the fused engine must report which
places its norms run. On CPU the fused op runs its torch reference; on a GPU (``DYNSTEER_TEST_DEVICE=cuda``, where
``"auto"`` is ``"fused"``) the Triton kernel under CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import dynsteer
from dynsteer import (Action, AddVector, CaptureSpec, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule,
                      SteeringSpec)
from dynsteer.spec import Ablation, ProjectionClamp
from tests.conftest import ON_GPU, make_llm, token_ids, unit, vec

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning", "she opened the door and"]
TOL = 1e-2 if ON_GPU else 1e-4  # GPU float32 matmuls may use TF32
PLACES = [(1, "post_block"), (2, "pre_attn")]  # both run by layer 2's input norm in the fused engine


def greedy(n: int = 12):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def workload(llm: Any, st: Any) -> dict[str, Any]:
    h, last = st.hidden_size, st.num_layers - 1
    out: dict[str, Any] = {"describe": st.describe()[0]}
    out["base"] = token_ids(llm.generate(PROMPTS, greedy()))
    specs = [
        None,
        # post_block of layer 0: fused into layer 1's input norm (site A)
        SteeringSpec(vectors=[AddVector(layer=0, site="post_block", vector=vec(h, 1))]),
        # pre_attn (site B) + post_attn (the mid norm) + a clamp, all of layer 1
        SteeringSpec(vectors=[AddVector(layer=1, site="pre_attn", vector=vec(h, 2)),
                              AddVector(layer=1, site="post_attn", vector=vec(h, 3))],
                     clamps=[ProjectionClamp(layer=1, site="post_attn", direction=unit(h, 4), lo=-0.5, hi=0.5)]),
        # the unfused ends: the model's first pre_attn (no residual yet) and its last post_block; an ablation
        SteeringSpec(vectors=[AddVector(layer=0, site="pre_attn", vector=vec(h, 5)),
                              AddVector(layer=last, site="post_block", vector=vec(h, 6))],
                     ablations=[Ablation(layer=2, site="pre_attn", direction=unit(h, 7))]),
    ]
    out["static"] = token_ids(st.generate(PROMPTS, greedy(), steering=specs))
    # the monitor (post_block of layer 1) and its gated action (pre_attn of layer 2) share one fused kernel
    mon = ProbeGate(name="m", layer=1, site="post_block", direction=unit(h, 0), sharpness=2.0, threshold=0.0)
    pol = DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[
        Action(kind="add", layer=2, site="pre_attn", vector=vec(h, 8))])])
    cap = CaptureSpec(sites=["post_block", "pre_attn"], layers=[1, 2], positions="all_generated")
    dyn = st.generate(PROMPTS, greedy(), policy=[pol, None, pol, pol], capture=cap)
    out["dyn"] = token_ids(dyn)
    out["gates"] = [None if o.trace is None else o.trace.gates() for o in dyn]
    out["captures"] = [{p: o.capture[p] for p in PLACES} for o in dyn]
    out["after"] = token_ids(llm.generate(PROMPTS, greedy()))
    return out


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def runs(request) -> dict[str, dict[str, Any]]:
    """Both engines' results for one family: Llama (vLLM's RMSNorm) and Gemma 2 (GemmaRMSNorm, 1 + w; sandwich
    norms, whose mid add-norm is pre_feedforward_layernorm)."""
    from dynsteer.testing.tiny_models import tiny_model

    path = tiny_model(request.param)
    results = {}
    for mode in ("op", "fused"):
        cfg = DynsteerConfig(forward=mode, capture_sites=("post_block", "pre_attn"), capture_layers=(1, 2))
        # float32 on GPU too: the two engines' norms (vLLM's and the fused kernel) sum in different orders, which in
        # bf16 can flip a near-tie of a random tiny model's greedy choice
        with make_llm(path, **{**cfg.engine_kwargs(), "dtype": "float32"}) as llm:
            results[mode] = workload(llm, dynsteer.attach(llm))
    return results


def test_fused_engine_reports_its_fused_places(runs):
    fused = set(runs["fused"]["describe"]["forward"]["fused_into_norm"])
    last = runs["fused"]["describe"]["shape"]["num_layers"] - 1
    # every post_attn, every pre_attn but the first, every post_block but the last
    assert {f"{i}:post_attn" for i in range(last + 1)} <= fused
    assert {f"{i}:pre_attn" for i in range(1, last + 1)} <= fused
    assert {f"{i}:post_block" for i in range(last)} <= fused
    assert "0:pre_attn" not in fused and f"{last}:post_block" not in fused
    assert runs["op"]["describe"]["forward"]["fused_into_norm"] == []


def test_fused_steers_like_separate_ops(runs):
    op, fused = runs["op"], runs["fused"]
    assert fused["base"] == op["base"] and fused["after"] == fused["base"]
    static = fused["static"]
    assert static[0] == fused["base"][0]  # unsteered row of the mixed batch
    assert all(static[i] != fused["base"][i] for i in (1, 2, 3))
    assert static == op["static"]


def test_fused_dynamic_gates_and_captures_match(runs):
    op, fused = runs["op"], runs["fused"]
    assert fused["dyn"] == op["dyn"]
    assert fused["dyn"][1] == fused["base"][1] and fused["gates"][1] is None
    assert any(fused["dyn"][i] != fused["base"][i] for i in (0, 2, 3))
    for g_op, g_fused in zip(op["gates"], fused["gates"]):
        if g_op is not None:
            assert np.ptp(g_fused) > 0  # a live gate, not a constant
            np.testing.assert_allclose(g_fused, g_op, atol=TOL)
    for c_op, c_fused in zip(op["captures"], fused["captures"]):
        for place in PLACES:
            np.testing.assert_allclose(c_fused[place], c_op[place], rtol=TOL, atol=TOL)
