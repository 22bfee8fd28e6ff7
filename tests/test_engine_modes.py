"""Engine modes beyond the fast in-process eager one: torch.compile'd forward and vLLM's multi-process default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dynsteer
from dynsteer import AddVector, DynsteerConfig, SteeringSpec
from tests.conftest import ENGINE_DEFAULTS, make_llm, token_ids

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning"]


def greedy(n: int = 10):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)


@pytest.mark.parametrize("forward", ["op", "fused", "inline"])
def test_compiled_forward_steers_and_restores(tiny_llama_path, forward):
    """Hooks are installed before torch.compile traces, so the compiled graph contains them (as one custom op per
    site, or as plain torch ops the compiler may fuse)."""
    with make_llm(tiny_llama_path, enforce_eager=False, **DynsteerConfig(forward=forward).engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        base = token_ids(llm.generate(PROMPTS, greedy()))
        v = (np.random.default_rng(2).standard_normal(st.hidden_size) * 8).astype(np.float32)
        st.set_layer_vector(2, v, site="post_attn")
        assert token_ids(llm.generate(PROMPTS, greedy())) != base
        st.clear_all()
        assert token_ids(llm.generate(PROMPTS, greedy())) == base
        spec = SteeringSpec(vectors=[AddVector(layer=1, site="pre_attn", vector=v)])
        mixed = token_ids(st.generate(PROMPTS, greedy(), steering=[None, spec, None]))
        assert mixed[0] == base[0] and mixed[2] == base[2] and mixed[1] != base[1]


def test_default_multiprocess_engine(tiny_llama_path):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    script = Path(__file__).with_name("mp_steering_script.py")
    proc = subprocess.run([sys.executable, str(script), str(tiny_llama_path), json.dumps(ENGINE_DEFAULTS)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).parents[1])
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(line[len("RESULT "):])
    assert r["steered"] != r["base"] and r["restored"] == r["base"]
    assert r["per_request"][1] == r["base"][1] and r["per_request"][0] == r["steered"][0]
    assert "vectors[0].layer" in r["bad"]
    assert r["describe"]["steps"] > 0  # the runtime lives in the engine's own process
    # dynamic policies in the spawned engine: open gate == static decode tier; no policy == baseline; traces come back
    assert r["dyn"][0] == r["decode_only"][0] and r["dyn"][1] == r["base"][1]
    assert r["dyn_traces"][1] is None and all(a == [1.0] for a in r["dyn_traces"][0])
    # sync controller: scale 0 on the first decode step, then on (one step of latency)
    assert r["sync_scale"][0] == 0.0 and set(r["sync_scale"][1:]) == {1.0}
    assert r["dyn_sync"][1] == r["decode_only"][1] and r["dyn_sync"][0][:2] == r["base"][0][:2]
    assert r["dyn_global"] == r["decode_only"] and r["after"] == r["base"]
