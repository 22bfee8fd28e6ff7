"""Prefix caching stays correct under steering: no false reuse of steered KV, no lost reuse for the rest."""

from __future__ import annotations

import numpy as np
import pytest

import dynsteer
from dynsteer import AddVector, SteeringSpec
from tests.conftest import make_llm, token_ids

BLOCK = 32
# Long enough for several full KV blocks, so cache hits are possible at all.
PROMPT = ("the quick brown fox jumps over the lazy dog while the old man reads a book by the window and "
          "the children play in the garden under the warm summer sun until the evening comes and the stars "
          "rise over the quiet town where everyone is asleep")


def greedy(n: int = 16):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)


def hits(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


def spec_for(steerer, tier: str, seed: int = 0) -> SteeringSpec:
    v = (np.random.default_rng(seed).standard_normal(steerer.hidden_size) * 4).astype(np.float32)
    return SteeringSpec(vectors=[AddVector(layer=1, vector=v, tier=tier)])


@pytest.fixture(scope="module")
def uncached_reference(tiny_llama_path):
    """Outputs of every case on an engine with prefix caching off: the ground truth."""
    with make_llm(tiny_llama_path, enable_prefix_caching=False, block_size=BLOCK) as llm:
        st = dynsteer.attach(llm)
        ref = {tier: token_ids(st.generate([PROMPT], greedy(), steering=spec_for(st, tier)))[0]
               for tier in ("base", "prefill", "decode")}
        ref["none"] = token_ids(llm.generate([PROMPT], greedy()))[0]
        st.set_layer_vector(1, spec_for(st, "base").vectors[0].vector)
        ref["global"] = token_ids(llm.generate([PROMPT], greedy()))[0]
    return ref


def test_steered_reruns_of_a_cached_prompt_equal_uncached_runs(tiny_llama_path, uncached_reference):
    with make_llm(tiny_llama_path, enable_prefix_caching=True, block_size=BLOCK, disable_log_stats=False) as llm:
        st = dynsteer.attach(llm)
        assert token_ids(llm.generate([PROMPT], greedy()))[0] == uncached_reference["none"]
        for tier in ("base", "prefill", "decode"):
            got = token_ids(st.generate([PROMPT], greedy(), steering=spec_for(st, tier)))[0]
            assert got == uncached_reference[tier], tier
        st.set_layer_vector(1, spec_for(st, "base").vectors[0].vector)  # global prefill steering: same rule
        assert token_ids(llm.generate([PROMPT], greedy()))[0] == uncached_reference["global"]
        st.clear_all()
        assert token_ids(llm.generate([PROMPT], greedy()))[0] == uncached_reference["none"]


def test_unsteered_and_decode_only_traffic_keeps_its_cache_hits(tiny_llama_path):
    with make_llm(tiny_llama_path, enable_prefix_caching=True, block_size=BLOCK, disable_log_stats=False) as llm:
        st = dynsteer.attach(llm)
        llm.generate([PROMPT], greedy())
        h0 = hits(llm)
        llm.generate([PROMPT], greedy())
        h1 = hits(llm)
        assert h1 - h0 >= BLOCK  # unsteered rerun: full prompt blocks come from the cache
        st.generate([PROMPT], greedy(), steering=spec_for(st, "decode"))
        h2 = hits(llm)
        assert h2 - h1 >= BLOCK  # decode-only steering does not fork the prompt's key
        st.generate([PROMPT], greedy(), steering=spec_for(st, "prefill"))
        h3 = hits(llm)
        assert h3 == h2  # prefill steering forks the key: no reuse of unsteered prompt KV


def test_blocks_generated_under_decode_steering_are_not_served_to_unsteered_requests(tiny_llama_path):
    """A follow-up prompt that extends prompt+steered continuation must not reuse the steered blocks."""
    with make_llm(tiny_llama_path, enable_prefix_caching=True, block_size=BLOCK, disable_log_stats=False) as llm:
        st = dynsteer.attach(llm)
        out = st.generate([PROMPT], greedy(3 * BLOCK), steering=spec_for(st, "decode"))[0]
        follow_up = {"prompt_token_ids": list(out.prompt_token_ids) + list(out.outputs[0].token_ids)}
        n_prompt_blocks = len(out.prompt_token_ids) // BLOCK
        h0 = hits(llm)
        llm.generate([follow_up], greedy(4))
        reused = hits(llm) - h0
        assert reused <= n_prompt_blocks * BLOCK  # prompt blocks may be reused, steered generated ones never
