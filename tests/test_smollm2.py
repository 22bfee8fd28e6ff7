"""Steering a real model: SmolLM2-135M-Instruct (converted once from the registry's GGUF)."""

from __future__ import annotations

import numpy as np
import pytest

import dynsteer
from dynsteer import AddVector, SteeringSpec
from tests.conftest import make_llm, token_ids

QUESTIONS = ["Write one sentence about your weekend.", "Describe the weather today.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def smollm2_path():
    from dynsteer.zoo import smollm2

    return smollm2()


@pytest.fixture(scope="module")
def sentiment_vector(smollm2_path):
    from dynsteer.cli.demo import contrastive_vector

    return contrastive_vector(smollm2_path, layer=15)


def test_smollm2_sentiment_steering_changes_output_and_restores(smollm2_path, sentiment_vector):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with make_llm(smollm2_path, max_model_len=512) as llm:
        st = dynsteer.attach(llm)
        assert st.num_layers == 30 and st.hidden_size == 576
        base = llm.chat(convs, params)
        assert "Paris" in base[2].outputs[0].text
        neg = SteeringSpec(vectors=[AddVector(layer=15, vector=sentiment_vector, scale=-1.5)])
        mixed = st.chat(convs, params, steering=[neg, None, neg])
        assert token_ids(mixed)[1] == token_ids(base)[1]
        assert token_ids(mixed)[0] != token_ids(base)[0] and token_ids(mixed)[2] != token_ids(base)[2]
        st.set_layer_vector(15, sentiment_vector, scale=-1.5)
        assert token_ids(llm.chat(convs, params)) != token_ids(base)
        st.clear_all()
        assert token_ids(llm.chat(convs, params)) == token_ids(base)
        assert np.linalg.norm(sentiment_vector) > 1.0


def test_smollm2_token_monitor_on_held_out_requests():
    """examples/dynamic_sentiment.py part one: a per-token probe trained on the model's own replies to the training
    requests, aggregated over each reply by an EMA latch on the device whose threshold was calibrated on the training
    replies' out-of-fold scores. On the 180 held-out requests (15 topics never trained on): >= 90 % of complaints
    steered (latch on; >= 85 % of their replies changed: a latch that turns on near the end of a reply may leave it
    as it was), >= 90 % of praise replies byte-identical, every reply whose latch never turned on byte-identical, and
    the in-graph gate equals the probe file's predict_proba within 1e-6."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import dynamic_sentiment

    res = dynamic_sentiment.run()
    assert sum(res.targeted) == 90 and len(res.targeted) == 180
    assert res.latched_targeted >= 0.9, res.latched_targeted
    assert res.steered_targeted >= 0.85, res.steered_targeted
    assert res.identical_others >= 0.9, res.identical_others
    for prompt, base, steered, fired in zip(res.prompts, res.baseline, res.steered, res.fired):
        if fired == 0:
            assert steered == base, prompt
    assert res.gate_error < 1e-6
    # the controller moved to the device decides as the Python controller on the host did: same tokens, same scales
    host = dynamic_sentiment.run(sync_tier="host", probe_path=res.probe_path, unsteered=False)
    assert host.steered == res.steered and host.scales == res.scales


def test_smollm2_prompt_level_gate_on_held_out_sentences():
    """examples/dynamic_sentiment.py part two: a prompt-level gate (reads='prompt_last') trained on the data set's
    training split opens on >= 90 % of the held-out negative prompts and changes >= 80 % of their replies (at the
    example's fluent dose, 0.15, a gate just above its floor adds half of that, which leaves some 24-token greedy
    replies unchanged), and leaves >= 90 % of the positive ones byte-identical; the held gate is the probe file's
    predict_proba of the last prompt token."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import dynamic_sentiment

    res = dynamic_sentiment.run_prompt_gate()
    assert res.n_negative >= 20 and res.n_positive >= 20
    assert res.opened_negative >= 0.9, res
    assert res.steered_negative >= 0.8, res
    assert res.identical_positive >= 0.9, res
    assert res.gate_error < 1e-5 and res.closed_ok, res
