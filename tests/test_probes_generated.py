"""Training data where the gate reads: ``collect_generated`` on SmolLM2 (rows are the generated tokens the
per-token monitor reads, under the chat template), its labelling, its input checks, and group-aware layer sweeps
that keep one prompt's tokens on one side of every split."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import dynsteer
from dynsteer import CaptureSpec, DynsteerConfig
from dynsteer.probes import Activations, LogisticProbe, calibrate, chat_prompts, collect_generated, layer_sweep
from dynsteer.probes.io import load_activations, save_activations
from tests.conftest import ON_GPU, make_llm

REPO = Path(__file__).resolve().parents[1]
LAYERS = (10, 20)
MAX_TOKENS = 10


def sentences(per_class: int) -> tuple[list[str], list[int]]:
    """The first ``per_class`` sentences of each class from the example's data, alternating classes."""
    with open(REPO / "examples" / "data" / "sentiment.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    pos = [r["text"] for r in rows if r["label"] == "positive"][:per_class]
    neg = [r["text"] for r in rows if r["label"] == "negative"][:per_class]
    return [s for pair in zip(pos, neg) for s in pair], [1, 0] * per_class


PROMPTS, LABELS = sentences(4)  # 8 prompts, 4 per class


@pytest.fixture(scope="module")
def smollm2_path():
    from dynsteer.zoo import smollm2

    return smollm2()


@pytest.fixture(scope="module")
def steerer(smollm2_path):
    cfg = DynsteerConfig(capture_sites=("post_block",), capture_layers=LAYERS)
    with make_llm(smollm2_path, **cfg.engine_kwargs()) as llm:
        yield dynsteer.attach(llm)


@pytest.fixture(scope="module")
def collected(steerer):
    """One collection shared by the tests that only read it (each collection is an engine pass)."""
    return collect_generated(steerer, PROMPTS, LABELS, layers=LAYERS, max_tokens=MAX_TOKENS, progress=False)


def greedy(n: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)


def hf_post_block(model_dir: Path, ids: list[int], layer: int) -> np.ndarray:
    """``post_block`` residual of ``layer`` at every position, from a plain transformers forward (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return hidden[layer + 1][0].numpy()  # hidden_states[0] is the embedding; the last layer's has the final norm


def test_rows_are_the_generated_tokens_under_the_chat_template(steerer, collected, smollm2_path):
    acts, st = collected, steerer
    # the chat template was applied: the rendered prompt holds SmolLM2's markers around the sentence
    for text, rendered in zip(PROMPTS, acts.prompts):
        assert f"<|im_start|>user\n{text}<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    # ... and the replies are what vLLM's own chat path gives for the same messages
    chat = st.llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], greedy(), use_tqdm=False)
    assert acts.outputs == [o.outputs[0].text for o in chat]

    # the same requests with capture of the generated positions: the rows are exactly those
    outs = st.generate(chat_prompts(st.llm, PROMPTS), greedy(),
                       capture=CaptureSpec(layers=LAYERS, positions="all_generated"))
    want_groups, want_ids, want_pos = [], [], []
    for k, out in enumerate(outs):
        P, gen = len(out.prompt_token_ids), list(out.outputs[0].token_ids)
        assert len(gen) >= 2
        want_groups += [k] * (len(gen) - 1)  # the last token is sampled, never fed back, so never read
        want_ids += gen[:-1]
        want_pos += list(range(P, P + len(gen) - 1))
    assert len(acts) == len(want_groups) == sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    assert acts.groups.tolist() == want_groups and acts.token_ids.tolist() == want_ids
    assert acts.token_positions.tolist() == want_pos and acts.n_positions.tolist() == [1] * len(acts)
    assert acts.y.tolist() == [LABELS[k] for k in want_groups]  # every token carries its prompt's class
    assert acts.tokens == [st.llm.get_tokenizer().decode([t]) for t in want_ids]
    assert acts.positions == "all_generated" and acts.site == "post_block" and acts.hidden_size == 576
    for layer in LAYERS:
        ref = np.concatenate([o.capture[(layer, "post_block")] for o in outs])
        assert acts.X[layer].shape == (len(acts), 576) and acts.X[layer].dtype == np.float32
        np.testing.assert_allclose(acts.X[layer], ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))

    # independent of dynsteer's capture: a transformers forward of prompt + reply at those positions
    out = outs[1]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref = hf_post_block(smollm2_path, ids, LAYERS[1])[acts.token_positions[acts.groups == 1]]
    got = acts.X[LAYERS[1]][acts.groups == 1]
    if ON_GPU:
        assert (np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)).max() < 1e-2
    else:
        np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))


def test_a_labeller_labels_each_token_and_drops_minus_one_on_raw_text(steerer):
    calls = []

    def rule(text):  # 1 for tokens holding an 'e', 0 for other words, -1 (dropped) for whitespace and punctuation
        return -1 if not text.strip(" .,!?\n") else int("e" in text)

    def labeller(k, token_ids, token_texts):
        calls.append((k, list(token_ids), list(token_texts)))
        return [rule(t) for t in token_texts]

    prompts = ["The weather today is", "My favourite food is"]
    acts = collect_generated(steerer, prompts, layers=(LAYERS[0],), chat_template=False, labeller=labeller,
                             max_tokens=MAX_TOKENS, progress=False)
    assert acts.prompts == prompts  # raw text: no template around it
    assert [k for k, _, _ in calls] == [0, 1]
    tok = steerer.llm.get_tokenizer()
    want_y, want_groups, want_ids = [], [], []
    for k, ids, texts in calls:
        assert texts == [tok.decode([t]) for t in ids] and len(ids) >= 1
        for t, text in zip(ids, texts):
            label = rule(text)
            if label != -1:
                want_y.append(label), want_groups.append(k), want_ids.append(t)
    assert 0 < len(acts) == len(want_y) < sum(len(ids) for _, ids, _ in calls)  # some rows were dropped
    assert acts.y.tolist() == want_y and acts.groups.tolist() == want_groups and acts.token_ids.tolist() == want_ids
    assert set(acts.y.tolist()) == {0, 1}

    # last_generated: one row per reply, the last token read, equal to that row of all_generated
    full = collect_generated(steerer, prompts, [1, 0], layers=(LAYERS[0],), chat_template=False,
                             max_tokens=MAX_TOKENS, progress=False)
    last = collect_generated(steerer.llm, prompts, [1, 0], layers=(LAYERS[0],), chat_template=False,  # the LLM
                             max_tokens=MAX_TOKENS, positions="last_generated", progress=False)
    ends = [int(np.flatnonzero(full.groups == k)[-1]) for k in range(2)]
    assert last.groups.tolist() == [0, 1] and last.y.tolist() == [1, 0] and last.positions == "last_generated"
    assert last.token_positions.tolist() == full.token_positions[ends].tolist()
    np.testing.assert_allclose(last.X[LAYERS[0]], full.X[LAYERS[0]][ends], rtol=1e-5,
                               atol=1e-5 * float(np.abs(full.X[LAYERS[0]]).max()))

    # a whole conversation is rendered as it stands, system message included
    conv = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Say hello."}]
    fr = collect_generated(steerer, [conv], [1], layers=(LAYERS[0],), max_tokens=4, progress=False)
    assert "<|im_start|>system\nYou answer in French.<|im_end|>" in fr.prompts[0] and 1 <= len(fr) <= 3


def test_bad_requests_fail_naming_the_field(steerer):
    kw = dict(layers=LAYERS, progress=False)
    cases = [
        (dict(prompts=[]), r"prompts: empty"),
        (dict(labels=[0, 1, 0]), r"labels: got 3 labels for 2 prompts"),
        (dict(labels=[0, 1], labeller=lambda k, ids, texts: [0] * len(ids)), r"labels and labeller"),
        (dict(layers=(99,)), r"collect_generated\.layers\[0\]: layer 99 out of range"),
        (dict(layers=(5,)), r"\(5, 'post_block'\) has no capture buffer"),
        (dict(layers=()), r"layers: empty"),
        (dict(site="post_mlp"), r"site: unknown site 'post_mlp'"),
        (dict(positions="last_prompt"), r"positions: 'last_prompt' is not a generated-position selector"),
        (dict(max_tokens=1), r"max_tokens: 1"),
        (dict(prompts=[["not a message"]]), r"prompts\[0\]: expected a string"),
        (dict(prompts=[[{"role": "user", "content": "hi"}]], chat_template=False), r"prompts\[0\]: a conversation"),
    ]
    for extra, match in cases:
        args = {"prompts": ["one", "two"], **kw, **extra}
        with pytest.raises(ValueError, match=match):
            collect_generated(steerer, args.pop("prompts"), args.pop("labels", None), **args)
    with pytest.raises(ValueError, match=r"labeller: returned 1 labels for the \d+ captured tokens of prompts\[0\]"):
        collect_generated(steerer, ["one"], layers=LAYERS, max_tokens=4, labeller=lambda k, ids, t: [0],
                          progress=False)


def test_a_layer_sweep_on_generated_tokens_keeps_each_prompt_in_one_fold(collected, tmp_path):
    acts = collected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 8 prompts cannot separate two layers; the splits are what is tested here
        sweep = layer_sweep(acts, LogisticProbe(cv=2), test_size=0.25, cv=3)
    g = acts.groups
    assert sweep.groups is not None and sweep.groups.tolist() == g.tolist()
    train_g, test_g = set(g[sweep.train_idx]), set(g[sweep.test_idx])
    assert not train_g & test_g and train_g | test_g == set(range(len(PROMPTS)))
    assert len(test_g) == 2 and {LABELS[k] for k in test_g} == {0, 1}  # whole prompts, one per class
    assert sweep.scores[LAYERS[0]].cv_folds == 3 and len(sweep.fold_idx) == 3
    fold_groups = [set(g[f]) for f in sweep.fold_idx]
    for i, a in enumerate(fold_groups):
        assert all(not a & b for b in fold_groups[i + 1:])  # no prompt's tokens in two folds
        assert {LABELS[k] for k in a} == {0, 1}
    assert sorted(np.concatenate(sweep.fold_idx).tolist()) == sorted(sweep.train_idx.tolist())
    # ... and the held-out tokens calibrate a threshold as any other scores do
    best = sweep.best_layer
    cal = calibrate(sweep.test_scores[best], acts.y[sweep.test_idx], 0.05, min_negatives=0)
    assert cal.n == len(sweep.test_idx) and cal.n_negatives == int(np.sum(acts.y[sweep.test_idx] == 0))
    # groups travel through the activations file, so `dynsteer probe train` keeps prompts whole too
    back = load_activations(save_activations(tmp_path / "gen.npz", acts))
    assert back.groups.tolist() == g.tolist()
    assert back.subset(sweep.test_idx).groups.tolist() == g[sweep.test_idx].tolist()


def test_group_aware_folds_do_not_leak_one_prompts_tokens():
    """Labels that belong to prompts, not to anything the rows share: per-token folds learn each prompt's offset and
    score near 1; folds that keep prompts whole score near chance. Without groups the old per-sample splits stay."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    n_prompts, per, d = 60, 6, 48
    g = np.repeat(np.arange(n_prompts), per)
    y = rng.permutation(np.arange(n_prompts) % 2)[g]
    X = rng.standard_normal((n_prompts, d))[g] * 3 + rng.standard_normal((len(g), d)) * 0.5  # prompt offset + noise
    acts = Activations(X={1: X}, y=y, site="post_block", model_id="m", hidden_size=d, groups=g)
    est = LogisticRegression(C=100.0, max_iter=5000)  # flexible enough to memorise prompts when it may
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grouped = layer_sweep(acts, est, cv=4)
        leaky = layer_sweep(acts, est, cv=4, groups=False)
        plain = layer_sweep(Activations(X={1: X}, y=y, site="post_block", model_id="m", hidden_size=d), est, cv=4)
    assert leaky.scores[1].cv_auroc_mean > 0.95 and grouped.scores[1].cv_auroc_mean < 0.75
    assert not set(g[grouped.train_idx]) & set(g[grouped.test_idx])
    fold_groups = [set(g[f]) for f in grouped.fold_idx]
    assert sum(len(a) for a in fold_groups) == len(set().union(*fold_groups))  # each prompt in one fold
    assert set(g[leaky.train_idx]) & set(g[leaky.test_idx])  # per-sample splits do cut prompts apart
    assert leaky.groups is None and plain.groups is None
    assert plain.train_idx.tolist() == leaky.train_idx.tolist() and plain.scores[1] == leaky.scores[1]
    with pytest.raises(ValueError, match="groups has 3 entries for 360 samples"):
        layer_sweep(acts, est, groups=[0, 1, 2])
