"""Probes: scikit-learn conventions, linear-form folding, the probe ↔ gate identity, the probe file, threshold
calibration, activation collection from a real engine, and the sentiment example end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from scipy.special import expit
from sklearn.base import clone
from sklearn.model_selection import cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

import dynsteer
from dynsteer import CaptureSpec, DynsteerConfig, ModelShape
from dynsteer.probes import (Activations, Calibration, DiffMeanProbe, LDAProbe, LogisticProbe, calibrate_threshold,
                             chat_prompts, collect, fpr_at, gate, gate_params, layer_sweep, load_probe,
                             recall_at_fpr, save_probe)
from tests.conftest import make_llm

REPO = Path(__file__).resolve().parents[1]
ESTIMATORS = [LogisticProbe(cv=3), LogisticProbe(cv=3, standardize=False), DiffMeanProbe(),
              DiffMeanProbe(standardize=True), LDAProbe()]
IDS = ["logistic", "logistic-raw", "diffmean", "diffmean-std", "lda"]


def synthetic(n: int = 300, d: int = 16, seed: int = 0, sep: float = 1.5) -> tuple[np.ndarray, np.ndarray]:
    """Two Gaussian classes with per-feature offsets and scales (so standardisation actually matters)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    direction = rng.standard_normal(d)
    X = rng.standard_normal((n, d)) + np.outer(y - 0.5, direction) * sep
    return X * rng.uniform(0.5, 5.0, d) + rng.uniform(-10, 10, d), y


# ---- estimator conventions ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("est", ESTIMATORS, ids=IDS)
def test_estimators_follow_sklearn_conventions(est):
    X, y = synthetic()
    params = est.get_params()
    fresh = clone(est)
    assert fresh.get_params() == params and fresh is not est
    assert fresh.set_params(**params) is fresh
    assert fresh.fit(X, y) is fresh
    assert not any(k.endswith("_") for k in vars(est)), "an unfitted estimator holds no learned state"
    assert est.get_params() == params  # fitting a clone leaves the original untouched
    assert fresh.coef_.shape == (1, X.shape[1]) and fresh.n_features_in_ == X.shape[1]
    proba = fresh.predict_proba(X)
    assert proba.shape == (len(X), 2) and np.allclose(proba.sum(1), 1.0)
    assert set(fresh.predict(X)) <= {0, 1} and 0.5 < fresh.score(X, y) <= 1.0
    scores = cross_val_score(est, X, y, cv=3)
    assert scores.mean() > 0.75, scores
    pipe = make_pipeline(StandardScaler(), clone(est)).fit(X, y)
    assert pipe.score(X, y) > 0.75


def test_set_params_changes_hyperparameters_and_labels_keep_their_names():
    X, y = synthetic()
    est = LogisticProbe().set_params(Cs=[0.01, 1.0], cv=2)
    assert est.Cs == [0.01, 1.0] and est.cv == 2
    labels = np.where(y == 1, "pos", "neg")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no reliance on scikit-learn defaults that are changing
        fitted = est.fit(X, labels)
    assert fitted.classes_.tolist() == ["neg", "pos"] and fitted.C_ in (0.01, 1.0)
    assert set(fitted.predict(X)) <= {"neg", "pos"}
    with pytest.raises(ValueError, match="binary"):
        LDAProbe().fit(X, y % 3 + (np.arange(len(y)) % 3 == 0))


# ---- linear form and the gate identity -----------------------------------------------------------------------------
@pytest.mark.parametrize("est", ESTIMATORS, ids=IDS)
def test_linear_form_folds_standardisation(est):
    X, y = synthetic()
    fitted = clone(est).fit(X, y)
    w, b = fitted.linear_form()
    Xt = synthetic(seed=1)[0]
    np.testing.assert_allclose(fitted.decision_function(Xt), Xt @ w + b, rtol=1e-10, atol=1e-9)
    # ... and the folded form equals the wrapped model on its own (standardised) inputs
    model, scaler = getattr(fitted, "model_", None), getattr(fitted, "scaler_", None)
    if model is not None:
        Z = scaler.transform(Xt) if scaler is not None else Xt
        np.testing.assert_allclose(model.decision_function(Z), Xt @ w + b, rtol=1e-9, atol=1e-8)
        np.testing.assert_allclose(model.predict_proba(Z), fitted.predict_proba(Xt), atol=1e-10)


def test_diffmean_is_the_midpoint_hyperplane():
    X, y = synthetic()
    w, b = DiffMeanProbe().fit(X, y).linear_form()
    mp, mn = X[y == 1].mean(0), X[y == 0].mean(0)
    np.testing.assert_allclose(w, mp - mn)
    assert b == pytest.approx(-w @ (mp + mn) / 2)
    assert (mp + mn) / 2 @ w + b == pytest.approx(0.0, abs=1e-8)


def test_gate_params_reproduce_a_fitted_logistic_probe_exactly():
    X, y = synthetic(d=32)
    probe = LogisticProbe(cv=3, standardize=True).fit(X, y)
    params = gate_params(*probe.linear_form())
    assert np.linalg.norm(params.probe) == pytest.approx(1.0)
    rng = np.random.default_rng(7)
    Xr = rng.standard_normal((500, 32)) * X.std(0) * 2 + X.mean(0)  # random inputs around (and beyond) the data
    np.testing.assert_allclose(gate(Xr, params), probe.predict_proba(Xr)[:, 1], rtol=0, atol=1e-6)
    # against the wrapped sklearn model on standardised inputs: no part of the identity leans on our own code paths
    sk = probe.model_.predict_proba(probe.scaler_.transform(Xr))[:, 1]
    np.testing.assert_allclose(gate(Xr, params), sk, rtol=0, atol=1e-6)


def test_gate_params_centred_on_a_calibrated_threshold():
    w, b, at = np.array([0.3, -1.2, 2.0]), 0.7, 1.5
    p = gate_params(w, b, at=at)
    x = np.random.default_rng(0).standard_normal((50, 3))
    np.testing.assert_allclose(gate(x, p), expit(x @ w + b - at), atol=1e-12)
    with pytest.raises(ValueError, match="zero"):
        gate_params(np.zeros(3), 1.0)


# ---- probe file ----------------------------------------------------------------------------------------------------
def test_probe_file_round_trip(tmp_path):
    X, y = synthetic(d=64)
    probe = LogisticProbe(cv=3).fit(X, y)
    cal = Calibration(threshold=0.25, target_fpr=0.05, auroc=0.97, n=len(y))
    path = save_probe(tmp_path / "p.safetensors", probe, model_id="m", layer=3, site="post_attn", calibration=cal)
    assert [p.name for p in tmp_path.iterdir()] == ["p.safetensors"], "no temporary file is left behind"
    loaded = load_probe(path)
    w, b = probe.linear_form()
    assert loaded.meta.format == "dynsteer.probe/1" and loaded.meta.method == "LogisticProbe"
    assert (loaded.layer, loaded.site, loaded.meta.hidden_size, loaded.meta.model_id) == (3, "post_attn", 64, "m")
    assert loaded.meta.bias == b and loaded.meta.calibration == cal  # JSON keeps float64 exactly
    np.testing.assert_array_equal(loaded.weight, w.astype(np.float32))
    np.testing.assert_allclose(loaded.decision_function(X), probe.decision_function(X), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(loaded.predict(X), loaded.decision_function(X) > 0.25)

    # the standardised form (weight + mean + scale) describes the same function
    mean, scale = X.mean(0), X.std(0)
    save_probe(tmp_path / "s.safetensors", w * scale, b + mean @ w, model_id="m", layer=3, mean=mean, scale=scale)
    std = load_probe(tmp_path / "s.safetensors")
    assert std.mean is not None and std.scale is not None
    np.testing.assert_allclose(std.decision_function(X), probe.decision_function(X), rtol=1e-4, atol=1e-3)


def test_probe_compatibility_errors_explain_the_mismatch(tmp_path):
    path = save_probe(tmp_path / "p.safetensors", np.ones(64), 0.0, model_id="model-a", layer=5)
    probe = load_probe(path)
    probe.check_compatible(ModelShape(num_layers=8, hidden_size=64, model_id="model-a"))
    with pytest.raises(ValueError, match=r"hidden size 64.*'model-b' has hidden size 128"):
        probe.check_compatible(ModelShape(num_layers=8, hidden_size=128, model_id="model-b"))
    with pytest.raises(ValueError, match=r"layer 5.*only 4 layers \(0..3\)"):
        probe.check_compatible(ModelShape(num_layers=4, hidden_size=64))
    with pytest.raises(ValueError, match=r"site 'post_block'.*does not hook"):
        probe.check_compatible(ModelShape(num_layers=8, hidden_size=64, sites=("pre_attn",)))
    with pytest.raises(ValueError, match=r"layer 5, which this engine does not hook"):
        probe.check_compatible(ModelShape(num_layers=8, hidden_size=64, layers=(1, 2)))
    with pytest.warns(UserWarning, match="trained on model 'model-a' but the engine runs 'model-b'"):
        probe.check_compatible(ModelShape(num_layers=8, hidden_size=64, model_id="model-b"))
    with pytest.raises(ValueError, match="model-b"):
        probe.check_compatible(ModelShape(num_layers=8, hidden_size=64), model_id="model-b", strict_model_id=True)
    dynsteer.save_vector(tmp_path / "v.safetensors", {0: np.ones(4)})
    with pytest.raises(ValueError, match="not a dynsteer.probe/1 probe file"):
        load_probe(tmp_path / "v.safetensors")


# ---- metrics -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", [0.0, 0.01, 0.05, 0.2])
def test_calibrated_threshold_meets_the_target_fpr(target):
    rng = np.random.default_rng(0)

    def draw(n):
        y = rng.integers(0, 2, n)
        return rng.standard_normal(n) + 2.0 * y, y

    s_cal, y_cal = draw(4000)
    t = calibrate_threshold(s_cal, y_cal, target)
    assert fpr_at(s_cal, y_cal, t) <= target  # guaranteed on the calibration data
    # the next lower threshold would break it (the threshold is as low, i.e. as sensitive, as the target allows)
    assert fpr_at(s_cal, y_cal, np.nextafter(t, -np.inf)) > target
    # On held data from the same distribution: the target up to the calibration set's sampling error (4 sigma of a
    # quantile estimated from n_neg negatives).
    s_held, y_held = draw(40000)
    n_neg = int((y_cal == 0).sum())
    assert fpr_at(s_held, y_held, t) <= target + 4 * np.sqrt(target * (1 - target) / n_neg) + 1e-3
    assert 0.0 <= recall_at_fpr(y_held, s_held, target) <= 1.0


def test_layer_sweep_finds_the_informative_layer():
    X, y = synthetic(n=200, d=12, sep=4.0)
    noise = np.random.default_rng(3).standard_normal(X.shape)
    acts = Activations(X={2: noise, 5: X, 9: noise[::-1].copy()}, y=y, site="post_block", model_id="m",
                       hidden_size=12)
    sweep = layer_sweep(acts, LogisticProbe(cv=3), test_size=0.3, seed=0)
    assert sweep.best_layer == 5 and sweep.best_auroc > 0.95 and sweep.auroc[2] < 0.8
    assert len(sweep.test_idx) == 60 and abs(y[sweep.test_idx].mean() - y.mean()) < 0.02  # stratified
    assert set(sweep.train_idx).isdisjoint(sweep.test_idx)
    assert "<- chosen" in sweep.table().splitlines()[2]
    assert sweep.separable and sweep.scores[5].cv_folds == 5 and sweep.scores[5].cv_auroc_mean > 0.95


def test_layer_sweep_chooses_by_cross_validation_on_the_training_split_alone():
    """Selection never looks at the held-out split: permuting the held-out samples' features cannot change the
    choice; ties in mean AUROC go to the smaller spread; layers the data cannot separate warn."""
    import warnings

    from dynsteer.probes import CalibrationWarning

    X, y = synthetic(n=240, d=12, sep=1.2)
    rng = np.random.default_rng(5)
    weak = X + rng.standard_normal(X.shape) * 2.0
    acts = Activations(X={3: weak, 7: X}, y=y, site="post_block", model_id="m", hidden_size=12)
    sweep = layer_sweep(acts, LogisticProbe(cv=3), seed=1)
    assert sweep.best_layer == 7 and sweep.ranking() == [7, 3]
    assert sweep.scores[7].cv_auroc_mean > sweep.scores[3].cv_auroc_mean
    # scramble the held-out rows of the chosen layer: held-out figures move, the choice does not
    X2 = X.copy()
    X2[sweep.test_idx] = rng.standard_normal((len(sweep.test_idx), 12))
    again = layer_sweep(Activations(X={3: weak, 7: X2}, y=y, site="post_block", model_id="m", hidden_size=12),
                        LogisticProbe(cv=3), seed=1)
    assert again.best_layer == 7 and again.scores[7].auroc < sweep.scores[7].auroc - 0.1
    assert again.scores[7].cv_auroc_mean == sweep.scores[7].cv_auroc_mean
    # two copies of one informative layer cannot be told apart: warned, and the earlier one is taken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tie = layer_sweep(Activations(X={4: X, 9: X.copy()}, y=y, site="post_block", model_id="m", hidden_size=12),
                          LogisticProbe(cv=3), seed=1)
    assert not tie.separable and tie.best_layer == 4
    assert any(issubclass(w.category, CalibrationWarning) and "not separable" in str(w.message) for w in caught)


def test_a_calibration_records_its_negatives_and_interval_and_warns_or_refuses_on_few():
    import warnings

    from dynsteer.probes import CalibrationWarning, calibrate, fpr_interval

    rng = np.random.default_rng(0)
    y = np.r_[np.zeros(400), np.ones(100)].astype(int)
    scores = np.r_[rng.standard_normal(400), rng.standard_normal(100) + 2.5]
    cal = calibrate(scores, y, 0.05)
    assert cal.n == 500 and cal.n_negatives == 400 and cal.fpr <= 0.05
    lo, hi = cal.fpr_interval
    assert lo <= cal.fpr <= hi and hi - lo < 0.06 and cal.confidence == 0.95
    # the exact binomial interval: 20 of 400 -> about [0.031, 0.076]; 0 of 9 -> [0, 0.336]
    assert abs(fpr_interval(20, 400)[0] - 0.0309) < 1e-3 and abs(fpr_interval(20, 400)[1] - 0.0760) < 1e-3
    assert fpr_interval(0, 9)[0] == 0.0 and abs(fpr_interval(0, 9)[1] - 0.3363) < 1e-3
    few_y, few_s = y[390:], scores[390:]  # 10 negatives
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        small = calibrate(few_s, few_y, 0.05)
    assert any(issubclass(w.category, CalibrationWarning) and "10 negatives" in str(w.message) for w in caught)
    assert small.n_negatives == 10 and small.fpr_interval[1] > 0.25  # honest: that "5 %" could be 30 %
    with pytest.raises(ValueError, match="min_negatives"):
        calibrate(few_s, few_y, 0.05, strict=True)


# ---- collection from a real engine -----------------------------------------------------------------------------------
PROMPTS = ["the quick brown fox jumps over the lazy dog", "once upon a time there was", "a small boat drifted",
           "my grandmother baked bread every sunday", "rain again", "we walked to the old mill by the river"]


@pytest.fixture(scope="module")
def capture_steerer(tiny_llama_path):
    cfg = DynsteerConfig(capture_sites=("post_block", "pre_attn"))
    with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
        yield dynsteer.attach(llm)


def test_collect_returns_one_row_per_prompt_equal_to_the_capture(capture_steerer):
    from vllm import SamplingParams

    st = capture_steerer
    labels = [1, 0, 1, 0, 1, 0]
    acts = collect(st, PROMPTS, labels, layers=(0, 2, 3), batch_size=4, progress=False)
    assert acts.layers == [0, 2, 3] and len(acts) == len(PROMPTS) and acts.hidden_size == st.hidden_size == 128
    assert acts.y.tolist() == labels and acts.site == "post_block" and acts.model_id == st.shape.model_id
    assert acts.n_positions.tolist() == [1] * len(PROMPTS)
    outs = st.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1),
                       capture=CaptureSpec(layers=(0, 2, 3), positions="all_prompt"))
    for layer in (0, 2, 3):
        assert acts.X[layer].shape == (len(PROMPTS), 128) and acts.X[layer].dtype == np.float32
        last = np.stack([o.capture[(layer, "post_block")][-1] for o in outs])
        # float32 CPU kernels round differently with another batch composition (4 + 2 vs 6 prompts): near-equal
        np.testing.assert_allclose(acts.X[layer], last, rtol=1e-5, atol=1e-5 * float(np.abs(last).max()))

    # multi-position selectors give the mean over the selected positions, still one row per prompt
    mean = collect(st, PROMPTS, layers=(2,), site="pre_attn", positions="all_prompt", progress=False)
    assert mean.y is None and mean.n_positions.tolist() == [len(o.prompt_token_ids) for o in outs]
    outs_pre = st.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1),
                           capture=CaptureSpec(layers=(2,), sites=("pre_attn",), positions="all_prompt"))
    ref = np.stack([o.capture[(2, "pre_attn")].mean(0) for o in outs_pre])
    np.testing.assert_allclose(mean.X[2], ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_collect_rejects_bad_requests(capture_steerer):
    with pytest.raises(ValueError, match="2 labels for 6 prompts"):
        collect(capture_steerer, PROMPTS, [0, 1], layers=(0,), progress=False)
    with pytest.raises(ValueError, match=r"\(1, 'post_attn'\) has no capture buffer"):
        collect(capture_steerer, PROMPTS, layers=(1,), site="post_attn", progress=False)


def test_chat_prompts_use_the_chat_template_without_a_second_bos():
    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and not tokenize and messages[0]["role"] == "user"
            return f"<s>[user]{messages[0]['content']}[assistant]"

        def encode(self, text, add_special_tokens=True):
            return [1] * add_special_tokens + [ord(c) for c in text]

    class LLM:
        def get_tokenizer(self):
            return Tok()

    (p,) = chat_prompts(LLM(), ["hi"])
    assert p["prompt_token_ids"] == [ord(c) for c in "<s>[user]hi[assistant]"]


# ---- the example (the CI check of examples/probe_training.py) ---------------------------------------------------------
@pytest.mark.slow
def test_probe_training_example_reaches_auroc_095(tmp_path):
    out = tmp_path / "probe.safetensors"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "probe_training.py"), str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"BEST_AUROC=([0-9.]+) BEST_LAYER=(\d+)", proc.stdout)
    assert m, proc.stdout[-3000:]
    assert float(m.group(1)) >= 0.95
    probe = load_probe(out)
    assert probe.layer == int(m.group(2)) and probe.meta.hidden_size == 576
    assert probe.meta.calibration is not None and probe.meta.calibration.target_fpr == 0.05


def test_probe_training_notebook_is_valid_and_matches_the_script():
    import json

    nb = json.loads((REPO / "examples" / "probe_training.ipynb").read_text())
    assert nb["nbformat"] == 4 and nb["cells"]
    script = (REPO / "examples" / "probe_training.py").read_text()
    script_lines = {line.strip() for line in script.splitlines()}
    for i, cell in enumerate(nb["cells"]):
        assert cell["cell_type"] in ("markdown", "code") and isinstance(cell["source"], list)
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and "execution_count" in cell
            src = "".join(cell["source"])
            compile(src, f"cell {i}", "exec")
            extra = [l for l in src.splitlines() if l.strip() and l.strip() not in script_lines]
            assert len(extra) <= 1, (i, extra)  # the same code as the script (the notebook sets out_path itself)


def test_loading_a_probe_for_another_hidden_size_into_an_engine_fails_clearly(capture_steerer, tmp_path):
    path = save_probe(tmp_path / "big.safetensors", np.ones(576), 0.0, model_id="smollm2", layer=2)
    with pytest.raises(ValueError, match=r"hidden size 576.*has hidden size 128"):
        load_probe(path).check_compatible(capture_steerer.shape)
    ok = save_probe(tmp_path / "ok.safetensors", np.ones(capture_steerer.hidden_size), 0.0,
                    model_id=capture_steerer.shape.model_id, layer=2)
    load_probe(ok).check_compatible(capture_steerer.shape)


def test_probe_files_and_estimators_share_one_set_of_semantics(tmp_path):
    """predict_proba is [n, 2] (column 1 positive) for estimators and loaded files alike; predict uses the file's
    calibration threshold when it has one, else 0, as documented; align pairs capture rows with trace positions."""
    from types import SimpleNamespace

    from dynsteer.probes import align, calibrate

    X, y = synthetic(n=300, d=8, sep=2.0)
    est = LogisticProbe(cv=3).fit(X, y)
    path = save_probe(tmp_path / "p.safetensors", est, model_id="m", layer=1)
    loaded = load_probe(path)
    assert loaded.predict_proba(X).shape == est.predict_proba(X).shape == (300, 2)
    np.testing.assert_allclose(loaded.predict_proba(X), est.predict_proba(X), atol=1e-5)
    np.testing.assert_array_equal(loaded.predict(X), est.predict(X))  # uncalibrated: decision > 0
    cal = calibrate(est.decision_function(X), y, 0.05)
    tight = load_probe(save_probe(tmp_path / "c.safetensors", est, model_id="m", layer=1, calibration=cal))
    np.testing.assert_array_equal(tight.predict(X), (est.decision_function(X) > cal.threshold).astype(int))
    assert tight.meta.calibration.n_negatives == int((y == 0).sum())
    class Cap:  # a capture's interface: positions, and rows per place
        positions = np.array([5, 6, 7, 8, 9])

        def __getitem__(self, place):
            return np.arange(5.0)[:, None] * np.ones((1, 3))

    cap = Cap()
    trace = SimpleNamespace(position=[7, 8, 9, 10])
    rows, at = align(cap, trace, (1, "post_block"))
    np.testing.assert_array_equal(rows[:, 0], [2.0, 3.0, 4.0])
    np.testing.assert_array_equal(at, [0, 1, 2])
