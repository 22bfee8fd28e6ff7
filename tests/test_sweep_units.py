"""Sweep building blocks without an engine: grid paths, metrics, relative dose and its guardrail, summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dynsteer import (Action, AddVector, DynamicSteeringPolicy, ProbeGate, Rule, SteeringSpec,
                      SteeringValidationError, SyncControllerSpec)
from dynsteer.dose import enforce_dose_limit, relative_doses
from dynsteer.sweep import SweepConfig, apply_point, grid_points, load_prompts, load_target, parse_axis
from dynsteer.sweep import metrics as M
from dynsteer.sweep.grid import GridPathError, point_label
from dynsteer.sweep.runner import BASELINE, make_variants, summarize

H = 8


def policy(scale: float = 2.0, controller: SyncControllerSpec | None = None, **kw) -> DynamicSteeringPolicy:
    mon = ProbeGate(name="m", layer=1, direction=np.eye(H)[0], sharpness=2.0, threshold=0.5)
    act = Action(kind="add", layer=2, vector=3.0 * np.eye(H)[1], scale=scale)
    return DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act])], controller=controller,
                                 **kw)


def test_grid_axes_apply_and_reject():
    ax = parse_axis("rules[0].actions[0].scale=0,2.5,-1")
    assert ax.values == (0, 2.5, -1)
    pts = grid_points([ax, parse_axis("monitors[0].threshold=0.1,0.2")])
    assert len(pts) == 6 and pts[1] == {"rules[0].actions[0].scale": 0, "monitors[0].threshold": 0.2}
    p = apply_point(policy(), pts[3])
    assert p.rules[0].actions[0].scale == 2.5 and p.monitors[0].threshold == 0.2
    assert np.array_equal(p.monitors[0].direction, policy().monitors[0].direction)  # vectors survive untouched
    assert point_label(pts[3]) == "scale=2.5, threshold=0.2"
    with pytest.raises(GridPathError, match=r"index \[3\] out of range"):
        apply_point(policy(), {"rules[3].actions[0].scale": 1.0})
    with pytest.raises(ValueError, match="sharpness"):
        apply_point(policy(), {"monitors[0].sharpness": -1.0})  # a value the field rejects
    with pytest.raises(ValueError, match="expected PATH"):
        parse_axis("scale")
    with pytest.raises(ValueError, match="expected field names"):
        parse_axis("rules[0]..scale=1")
    spec = SteeringSpec(vectors=[AddVector(layer=0, vector=np.ones(H))])
    assert apply_point(spec, {"vectors[0].tier": "decode"}).vectors[0].tier == "decode"


def test_metrics_definitions():
    assert M.distinct_n([1, 2, 1, 2], 1) == 0.5 and M.distinct_n([7], 2) == 1.0
    assert M.repeated_ngram_rate([1, 2, 3, 4] * 3, 4) == pytest.approx(1 - 4 / 9)
    assert M.repeated_ngram_rate([1, 2, 3], 4) == 0.0
    assert M.concept_words("I love it. Love, LOVE!", ["love"]) == pytest.approx(3 / 5)
    assert M.concept_words("anything", []) is None
    assert M.perplexity([math.log(0.25)] * 3) == pytest.approx(4.0) and M.perplexity([]) is None
    assert M.mean_or_none([None, True, False]) == 0.5 and M.mean_or_none([None]) is None


def test_relative_dose_reject_and_clip():
    norms = {(2, "post_block"): 20.0}
    (e,) = relative_doses(policy(), norms)
    assert (e.where, e.vector_norm, e.dose, e.peak_dose) == ("rules[0].actions[0]", 3.0, 0.3, 0.3)
    latch = SyncControllerSpec(kind="latch", on=1.0, off=0.0, scale=2.0)  # dyn_scale up to 2 doubles the peak
    assert relative_doses(policy(controller=latch), norms)[0].peak_dose == pytest.approx(0.6)
    with pytest.raises(SteeringValidationError, match=r"rules\[0\]\.actions\[0\]\.scale: relative dose 0\.6 .*"
                                                      r"layer 2 post_block.*exceeds max_relative_dose 0\.5"):
        enforce_dose_limit(policy(controller=latch, max_relative_dose=0.5), norms)
    clipped, (c,) = enforce_dose_limit(policy(-2.0, latch, max_relative_dose={"limit": 0.5, "mode": "clip"}), norms)
    assert clipped.rules[0].actions[0].scale == pytest.approx(-2.0 * 0.5 / 0.6)  # sign kept
    assert c.clipped_from == -2.0 and c.peak_dose == 0.5
    same, _ = enforce_dose_limit(policy(max_relative_dose=1.0), norms)
    assert same == policy()  # within the limit: unchanged, less the guardrail it has been checked against
    spec = SteeringSpec(vectors=[AddVector(layer=2, vector=np.full(H, 0.5), scale=-4.0)])
    assert relative_doses(spec, norms)[0].dose == pytest.approx(4.0 * math.sqrt(H) * 0.5 / 20.0)
    with pytest.raises(SteeringValidationError, match="no residual norm"):
        relative_doses(spec, {})
    assert DynamicSteeringPolicy.from_yaml(policy(max_relative_dose=0.5).to_yaml()).max_relative_dose.limit == 0.5


def test_prompt_and_target_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "hi", "class": "a"}\n"bare"\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    items = load_prompts(f)
    assert [(i.text(), i.cls) for i in items] == [("hi", "a"), ("bare", "unlabelled"), ("yo", "unlabelled")]
    f.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2"):
        load_prompts(f)
    t = tmp_path / "t.yaml"
    t.write_text(policy().to_yaml())
    assert isinstance(load_target(t), DynamicSteeringPolicy)
    t.write_text(SteeringSpec(vectors=[AddVector(layer=0, vector=np.ones(H))]).to_yaml())
    assert isinstance(load_target(t), SteeringSpec)
    with pytest.raises(GridPathError, match="no such field"):
        SweepConfig.build(policy(), grid=["rules[0].actions[0].scael=1"], prompts=["x"])


def test_summary_selectivity_and_side_effects():
    cfg = SweepConfig.build(policy(max_relative_dose={"limit": 0.35, "mode": "reject"}),
                            grid=["rules[0].actions[0].scale=1.0,3.0"],
                            prompts=[{"prompt": "bad", "label": "t"}, {"prompt": "good", "label": "o"}],
                            target_class="t")
    variants = make_variants(cfg, {(2, "post_block"): 20.0})
    assert [v.error is None for v in variants] == [True, True, False]  # scale 3: dose 0.45 > 0.35, rejected
    assert "relative dose 0.45" in variants[2].error
    recs = []
    for v, changed in ((BASELINE, (False, False)), ("v001", (True, False))):
        for p, (label, ch) in enumerate(zip(("t", "o"), changed)):
            recs.append({"variant": v, "label": label, "changed": ch, "identical": not ch, "fired": ch,
                         "steered_tokens": int(ch), "gate_rate": 0.5 * ch, "concept_probe": 0.1 + 0.5 * ch,
                         "concept_words": None, "perplexity": 3.0, "repeat_4gram": 0.0, "distinct_1": 1.0,
                         "distinct_2": 1.0})
    rows = summarize(cfg, variants, recs)
    v1 = {r["class"]: r for r in rows if r["variant"] == "v001"}
    assert v1["all"]["selectivity"] == "1" and v1["all"]["side_effect_identical_rate"] == "1"
    assert v1["t"]["concept_probe"] == "0.6" and v1["all"]["concept_probe"] == "0.35"
    assert v1["all"]["max_relative_dose"] == "0.15" and v1["all"]["concept_words"] == ""
    v2 = [r for r in rows if r["variant"] == "v002"]
    assert v2[0]["n"] == "0" and "relative dose" in v2[0]["error"]


def test_cli_engine_config_covers_probe_and_actions(tmp_path):
    from dynsteer.cli.sweep import engine_config
    from dynsteer.probefile.fileformat import save_probe
    from dynsteer.probes.estimators import DiffMeanProbe

    X = np.vstack([np.eye(H)[0] + 0.1 * np.arange(H), -np.eye(H)[0] + 0.1 * np.arange(H)])
    path = tmp_path / "p.safetensors"
    save_probe(path, DiffMeanProbe().fit(X, np.array([1, 0])), model_id="m", layer=4, site="pre_attn")
    cfg = SweepConfig.build(policy(), grid=[], prompts=["x"], probe_file=path)
    dc = engine_config(cfg)
    assert set(dc.capture_sites) == {"pre_attn", "post_block"} and set(dc.capture_layers) == {2, 4}
    assert dc.max_gates == 2
