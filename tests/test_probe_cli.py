"""``dynsteer probe train|eval``: activations (a saved file, or a capture folder written by a real engine) in, a probe
file and a report out."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from dynsteer.cli.app import app
from dynsteer.probes import Activations, load_probe
from dynsteer.probes.io import load_activations, save_activations
from tests.conftest import make_llm

runner = CliRunner()
HIDDEN, SIGNAL_LAYER = 16, 2


def synthetic(n: int, seed: int) -> Activations:
    """Three layers; only SIGNAL_LAYER separates the classes (a shift along one direction, overlapping a little)."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    direction = np.eye(HIDDEN, dtype=np.float32)[3]
    X = {layer: rng.standard_normal((n, HIDDEN)).astype(np.float32) for layer in (0, 1, SIGNAL_LAYER)}
    X[SIGNAL_LAYER] += np.outer(2.5 * y, direction).astype(np.float32)
    return Activations(X=X, y=y, site="post_block", model_id="synthetic", hidden_size=HIDDEN)


def test_activations_file_round_trips(tmp_path):
    acts = synthetic(20, 0)
    back = load_activations(save_activations(tmp_path / "a.npz", acts))
    assert back.layers == acts.layers and np.array_equal(back.y, acts.y) and back.model_id == "synthetic"
    assert all(np.array_equal(back.X[k], acts.X[k]) for k in acts.X)


def test_train_chooses_the_signal_layer_and_eval_scores_fresh_data(tmp_path):
    train_file = save_activations(tmp_path / "train.npz", synthetic(400, 0))
    probe_file, report = tmp_path / "p.safetensors", tmp_path / "train.json"
    res = runner.invoke(app, ["probe", "train", str(train_file), "--out", str(probe_file), "--report", str(report)])
    assert res.exit_code == 0, res.output
    assert "chosen layer 2" in res.output and "held-out AUROC" in res.output and "wrote" in res.output
    rep = json.loads(report.read_text())
    assert rep["layer"] == SIGNAL_LAYER and rep["n_train"] == 280 and rep["n_test"] == 120
    assert rep["layers"]["2"]["auroc"] > 0.9 > max(rep["layers"]["0"]["auroc"], rep["layers"]["1"]["auroc"])
    cal = rep["calibration"]
    assert cal["n_negatives"] == 60 and cal["target_fpr"] == 0.05 and cal["fpr"] <= 0.05
    probe = load_probe(probe_file)
    assert probe.layer == SIGNAL_LAYER and probe.meta.model_id == "synthetic"
    assert probe.meta.calibration.threshold == pytest.approx(cal["threshold"])

    fresh = save_activations(tmp_path / "fresh.npz", synthetic(2000, 1))
    res = runner.invoke(app, ["probe", "eval", str(probe_file), str(fresh), "--report", str(tmp_path / "e.json")])
    assert res.exit_code == 0, res.output
    ev = json.loads((tmp_path / "e.json").read_text())
    assert ev["n"] == 2000 and ev["n_negatives"] == 1000 and ev["auroc"] > 0.9 and ev["calibrated"]
    lo, hi = ev["fpr_interval"]
    assert lo <= ev["fpr"] <= hi and ev["fpr"] < 0.15  # near the 5 % target on fresh data
    assert "auroc" in res.output and "fpr 95 % interval" in res.output


def test_bad_inputs_name_the_problem(tmp_path):
    acts = synthetic(40, 0)
    f = save_activations(tmp_path / "a.npz", acts)
    res = runner.invoke(app, ["probe", "train", str(f), "--out", str(tmp_path / "p.st"), "--layer", "7"])
    assert res.exit_code != 0 and "layers [7] are not in the data" in res.output
    res = runner.invoke(app, ["probe", "train", str(f), "--out", str(tmp_path / "p.st"), "--method", "svm"])
    assert res.exit_code != 0 and "--method" in res.output
    acts.y = None
    g = save_activations(tmp_path / "unlabelled.npz", acts)
    res = runner.invoke(app, ["probe", "train", str(g), "--out", str(tmp_path / "p.st")])
    assert res.exit_code != 0 and "no labels" in res.output
    other = synthetic(40, 0)
    other.X = {0: other.X[0]}
    probe = tmp_path / "p.safetensors"
    assert runner.invoke(app, ["probe", "train", str(f), "--out", str(probe), "--layer", "2"]).exit_code == 0
    res = runner.invoke(app, ["probe", "eval", str(probe), str(save_activations(tmp_path / "o.npz", other))])
    assert res.exit_code != 0 and "reads layer 2" in res.output


def test_train_from_a_capture_folder_written_by_the_engine(tiny_llama_path, tmp_path):
    """Captured activations in: a filesystem consumer's folder plus tag,label rows; the probe reads the last prompt
    token, which here differs by class (prompts end in different words)."""
    import dynsteer
    from vllm import SamplingParams

    root = tmp_path / "caps"
    cfg = dynsteer.DynsteerConfig(capture_sites=("post_block",), capture_layers=(1, 2),
                                  capture_consumers={"memory": {},
                                                     "filesystem": {"root": str(root), "layout": "packed"}})
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "once", "upon", "time", "world"]
    prompts = [" ".join(rng.choice(words, 5)) + (" good" if i % 2 else " bad") for i in range(40)]
    spec = dynsteer.CaptureSpec(layers=(1, 2), positions="last_prompt", consumers=("memory", "filesystem"))
    with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
        outs = dynsteer.attach(llm).generate(prompts, SamplingParams(max_tokens=1), capture=spec)
    labels = tmp_path / "labels.csv"
    labels.write_text("tag,label\n" + "".join(f"{o.capture.tag},{i % 2}\n" for i, o in enumerate(outs)))
    probe, report = tmp_path / "cap.safetensors", tmp_path / "cap.json"
    res = runner.invoke(app, ["probe", "train", str(root), "--labels", str(labels), "--out", str(probe),
                              "--report", str(report), "--model-id", str(tiny_llama_path)])
    assert res.exit_code == 0, res.output
    rep = json.loads(report.read_text())
    assert rep["n_train"] + rep["n_test"] == 40 and set(rep["layers"]) == {"1", "2"}
    assert rep["layers"][str(rep["layer"])]["auroc"] == 1.0
    p = load_probe(probe)
    assert p.meta.hidden_size == 128 and p.meta.model_id == str(tiny_llama_path) and p.site == "post_block"
    res = runner.invoke(app, ["probe", "eval", str(probe), str(root), "--labels", str(labels)])
    assert res.exit_code == 0 and "1.0000" in res.output, res.output
