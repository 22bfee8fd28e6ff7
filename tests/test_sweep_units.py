"""Sweep building blocks without an engine: grid paths, metrics, relative dose and its guardrail, summaries."""

from __future__ import annotations

import math
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from dynsteer import (Action, AddVector, DynamicSteeringPolicy, ProbeGate, Rule, SteeringSpec,
                      SteeringValidationError, SyncControllerSpec)
from dynsteer.dose import enforce_dose_limit, relative_doses
from dynsteer.sweep import SweepConfig, apply_point, grid_points, load_prompts, load_target, parse_axis
from dynsteer.sweep import metrics as M
from dynsteer.sweep.grid import GridPathError, point_label
from dynsteer.sweep.report_tables import short
from dynsteer.sweep.runner import BASELINE, make_variants, summarize
from tests.report_check import CHROMIUM

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
    assert [v.error is None for v in variants] == [True, True, False, True]  # scale 3: dose 0.45 > 0.35, rejected
    assert variants[3].control_of == "v001"  # a control for the valid variant only
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


def synthetic_result(out_dir, classes=("complaint", "praise", "neutral"), scales=(0.0, 2.0, 4.0, 8.0),
                     thresholds=(-1.234567, 0.5, 1.987654)):
    """A policy sweep's result without an engine: 2 axes, 3 classes, traces and doses, deterministic values."""
    from dynsteer.sweep.types import SweepResult

    prompts = [{"prompt": f"prompt {i} about {c}", "label": c} for c in classes for i in range(2)]
    cfg = SweepConfig.build(policy(), grid=[f"rules[0].actions[0].scale={','.join(map(repr, scales))}",
                                            f"monitors[0].threshold={','.join(map(repr, thresholds))}"],
                            prompts=prompts, target_class=classes[0], words=("good",))
    variants = make_variants(cfg, {(2, "post_block"): 23.456789})
    rng = np.random.default_rng(0)
    recs = []
    for v in variants:
        for p, item in enumerate(cfg.prompts):
            ch = v.id != BASELINE and (item.cls == classes[0] or rng.random() < 0.2)
            trace = [round(float(x), 6) for x in rng.random(12)]
            recs.append({"variant": v.id, "prompt_index": p, "sample": 0, "label": item.cls, "changed": ch,
                         "identical": not ch, "fired": ch, "steered_tokens": int(ch) * 3,
                         "gate_rate": float(rng.random()), "concept_probe": float(rng.random()),
                         "concept_words": float(rng.random()), "perplexity": 1.0 + 10 * float(rng.random()),
                         "repeat_4gram": float(rng.random()) / 7, "distinct_1": float(rng.random()),
                         "distinct_2": float(rng.random()), "applied_dose": float(rng.random()) / 3,
                         "text": f"output of {v.id} for prompt {p} " * 3, "token_ids": [1, 2, 3],
                         "probe_trace": None, "gate_trace": trace})
    return cfg, SweepResult(out_dir=out_dir, variants=variants, generated=len(recs), skipped=0, records=recs,
                            summary=summarize(cfg, variants, recs))


EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "sweeps"


def example_command(path: Path) -> list[str]:
    """The ``dynsteer sweep ...`` command in an example file's header comment (continued with backslashes)."""
    lines = [ln.lstrip("#").strip() for ln in path.read_text().splitlines() if ln.startswith("#")]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("dynsteer sweep"))
    text = ""
    for ln in lines[start:]:
        text += ln.rstrip("\\").strip() + " "
        if not ln.endswith("\\"):
            break
    return shlex.split(text)[1:]  # without the program name


def test_vector_references_in_policy_files(tmp_path):
    from dynsteer.vectors import save_vector

    np.save(tmp_path / "v.npy", np.arange(H, dtype=np.float32))
    save_vector(tmp_path / "v.safetensors", {2: np.ones(H), 5: np.full(H, 2.0)})
    probe_dir = tmp_path / "probes"
    probe_dir.mkdir()
    t = tmp_path / "spec.yaml"
    t.write_text("vectors:\n"
                 "- {layer: 2, vector: {file: v.npy}}\n"
                 "- {layer: 5, vector: {file: v.safetensors}}\n"  # the entry's layer picks the file's vector
                 "- {layer: 1, vector: {file: v.safetensors, layer: 2}}\n"
                 "- {layer: 1, vector: 'file:v.npy'}\n"
                 "- {layer: 1, vector: {name: happy}}\n"
                 "- {layer: 1, vector: sad}\n"
                 "clamps:\n- {layer: 1, direction: {file: v.npy}, hi: 1.0}\n")
    spec = load_target(t)
    got = [e.vector for e in spec.vectors]
    assert np.array_equal(got[0], np.arange(H)) and np.array_equal(got[1], np.full(H, 2.0))
    assert np.array_equal(got[2], np.ones(H)) and np.array_equal(got[3], np.arange(H))
    assert got[4:] == ["happy", "sad"] and np.array_equal(spec.clamps[0].direction, np.arange(H))
    cfg = SweepConfig.build(spec, prompts=["x"])
    assert cfg.base["vectors"][0]["vector"] == {"b64": cfg.target().model_dump(mode="json")["vectors"][0]["vector"]["b64"]}

    def fails(text: str, match: str, name: str = "spec.yaml") -> None:
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=match):
            load_target(tmp_path / name)

    fails("vectors:\n- {layer: 1, vector: {file: nope.npy}}\n", r"spec\.yaml: vectors\[0\]\.vector: no such file")
    fails("vectors:\n- {layer: 3, vector: {file: v.safetensors}}\n",
          r"vectors\[0\]\.vector: .*has no vector for layer 3 \(layers: \[2, 5\]\)")
    fails("vectors:\n- {vector: {file: v.safetensors}}\n", r"vectors\[0\]\.vector: .*holds layers \[2, 5\]")
    fails("vectors:\n- {layer: 1, vector: {fiel: v.npy}}\n", r"vectors\[0\]\.vector: expected .*got keys \['fiel'\]")
    fails("vectors:\n- {layer: 1, vector: {file: spec.yaml}}\n", r"vectors\[0\]\.vector: .*expected a \.npy")
    (tmp_path / "m.npy").write_bytes(b"not numpy")
    fails("vectors:\n- {layer: 1, vector: {file: m.npy}}\n", r"vectors\[0\]\.vector: .*not a numpy array file")
    np.save(tmp_path / "m2.npy", np.ones((2, H)))
    fails("vectors:\n- {layer: 1, vector: {file: m2.npy}}\n", r"vectors\[0\]\.vector: expected a 1-D vector")
    mon = policy().model_dump(mode="json")
    mon["monitors"][0]["direction"] = {"name": "happy"}
    import yaml

    fails(yaml.safe_dump(mon), r"monitors\[0\]\.direction: a monitor's direction cannot be a registered name",
          "policy.yaml")
    mon["monitors"][0]["direction"] = {"file": "v.npy"}
    mon["rules"][0]["actions"][0]["vector"] = {"file": "v.safetensors", "layer": 5}
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(mon))
    p = load_target(tmp_path / "policy.yaml")
    assert np.array_equal(p.monitors[0].direction, np.arange(H))
    assert np.array_equal(p.rules[0].actions[0].vector, np.full(H, 2.0))

    # a grid over vectors: files (relative to the current directory) and names, variants named by them
    with pytest.MonkeyPatch.context() as m:
        m.chdir(tmp_path)
        cfg = SweepConfig.build(policy(), grid=["rules[0].actions[0].vector=file:v.npy,{file: v.safetensors, "
                                                "layer: 5},happy", "rules[0].actions[0].scale=1,2"], prompts=["x"])
        labels = [v.label for v in make_variants(cfg, None)]
        assert labels[1:4] == ["vector=v.npy, scale=1", "vector=v.npy, scale=2", "vector=v.safetensors:5, scale=1"]
        assert labels[5] == "vector=happy, scale=1"
        assert np.array_equal(apply_point(cfg.target(), grid_points(list(cfg.grid))[2]).rules[0].actions[0].vector,
                              np.full(H, 2.0))
        np.save(tmp_path / "v.npy", np.ones(H, dtype=np.float32))  # another vector in the same file: another sweep
        again = SweepConfig.build(policy(), grid=["rules[0].actions[0].vector=file:v.npy,{file: v.safetensors, "
                                                  "layer: 5},happy", "rules[0].actions[0].scale=1,2"], prompts=["x"])
        assert again.fingerprint() != cfg.fingerprint()
        with pytest.raises(ValueError, match=r"--grid rules\[0\]\.actions\[0\]\.vector \(value 2\): no such file"):
            SweepConfig.build(policy(), grid=["rules[0].actions[0].vector=file:v.npy,file:w.npy"], prompts=["x"])


def _example_config(path: Path, monkeypatch):
    """The CLI's SweepConfig (and registered vectors) for an example file's own command line, without an engine."""
    from typer.testing import CliRunner

    import dynsteer.cli.sweep as cli_sweep
    import dynsteer.zoo
    from dynsteer.cli.app import app

    seen = {}

    class Stop(Exception):
        pass

    def fake_engine(model, cfg, **kw):
        seen.update(cfg=cfg, **kw)
        raise Stop

    monkeypatch.setattr(cli_sweep, "make_engine", fake_engine)
    monkeypatch.setattr(dynsteer.zoo, "smollm2", lambda: "unused")
    argv = example_command(path)
    with monkeypatch.context() as m:
        m.chdir(EXAMPLES.parents[1])  # the commands are written from the repository root
        res = CliRunner().invoke(app, argv)
    assert isinstance(res.exception, Stop), (path.name, res.output)
    named = {}
    for i, a in enumerate(argv):
        if a == "--vector":
            name, _, f = argv[i + 1].partition("=")
            named[name] = np.load(EXAMPLES.parents[1] / f)
    return seen["cfg"], named


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_example_sweep_files_parse_and_validate(name, monkeypatch):
    """Every example policy/spec file loads, and its header's command line builds a sweep whose every variant
    validates, with vectors of SmolLM2-135M's hidden size (576)."""
    cfg, named = _example_config(EXAMPLES / name, monkeypatch)
    assert cfg.grid and cfg.target_class == "complaint" and len(cfg.prompts) == 6
    assert set(cfg.registered_vectors) == set(named)  # a registered vector's digest is part of the fingerprint
    if named:
        other = cfg.model_copy(update={"registered_vectors": {k: "0" * 64 for k in named}})
        assert other.fingerprint() != cfg.fingerprint()
    variants = make_variants(cfg, None, named)
    assert len(variants) > 2 and all(v.error is None for v in variants), [v.error for v in variants]
    by = {v.id: v for v in variants}
    controls = [v for v in variants if v.control_of is not None]  # a control per variant that adds something
    assert controls and all(c.label == "random: " + by[c.control_of].label for c in controls)
    for v in variants[1:]:
        obj = v.policy or v.spec
        vecs = ([a.vector for r in obj.rules for a in r.actions] if v.policy is not None
                else [e.vector for e in obj.vectors])
        for vec in vecs:
            arr = named[vec] if isinstance(vec, str) else vec
            assert np.asarray(arr).shape == (576,), name
            assert np.linalg.norm(arr) == pytest.approx(1.0, rel=1e-5)


def test_cli_engine_options_and_log_level(tmp_path, monkeypatch):
    """Engine flags and --engine-arg reach vllm.LLM (dynsteer's own config kept); vLLM logs errors only unless
    --verbose, in this process and (through the environment) in the engine core."""
    import logging

    import vllm
    from typer.testing import CliRunner

    from dynsteer.cli.app import app

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(**kw):
        seen.update(kw, level=os.environ.get("VLLM_LOGGING_LEVEL"), logger=logging.getLogger("vllm").level)
        raise Stop

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "x")  # restored after the test
    saved_level = logging.getLogger("vllm").level
    monkeypatch.setattr(logging.getLogger("vllm"), "level", saved_level)
    t = tmp_path / "p.yaml"
    t.write_text(policy().to_yaml())
    base = ["sweep", str(t), "--prompts", str(EXAMPLES / "prompts.jsonl"), "--model", "m", "--out", str(tmp_path)]

    def run(*extra: str):
        monkeypatch.delenv("VLLM_LOGGING_LEVEL")
        seen.clear()
        return CliRunner().invoke(app, [*base, *extra])

    res = run("--no-enforce-eager", "--kv-cache-gb", "0.5", "--dtype", "bfloat16", "--max-model-len", "300",
              "--max-num-seqs", "4", "--engine-arg", "max-num-batched-tokens=1024", "--engine-arg", "max_num_seqs=8")
    assert isinstance(res.exception, Stop), res.output
    assert (seen["model"], seen["dtype"], seen["max_model_len"], seen["enforce_eager"]) == ("m", "bfloat16", 300, False)
    assert seen["kv_cache_memory_bytes"] == 2**29 and seen["max_num_batched_tokens"] == 1024
    assert seen["max_num_seqs"] == 8  # --engine-arg wins over the flag
    assert "dynsteer" in seen["additional_config"]
    assert seen["level"] == "ERROR" and seen["logger"] == logging.ERROR
    res = run("--verbose")
    assert isinstance(res.exception, Stop) and seen["level"] == "INFO" and seen["logger"] == logging.INFO
    assert seen["enforce_eager"] is True and "kv_cache_memory_bytes" not in seen
    for bad, match in ((["--engine-arg", "max_num_seq=3"], "max_num_seq: not a vLLM engine argument .*max_num_seqs"),
                       (["--engine-arg", "model=x"], "model: set by the sweep itself"),
                       (["--engine-arg", "oops"], "expected KEY=VALUE"),
                       (["--vector", "v=nope.npy"], "--vector v: no such file")):
        res = run(*bad)
        assert res.exit_code == 2 and not seen, res.output
        assert re.search(match, " ".join(res.output.split())), res.output


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (the test command installs it: apt-get install "
                                               "chromium)")
def test_report_layout_at_1280px(tmp_path):
    """A 12-variant, 3-class policy sweep's report in headless Chromium at 1,280 px: the selectivity column is on
    screen and the page does not overflow sideways; one row per variant, named by its grid values; the tables show
    the CSV's values to 4 significant digits."""
    from dynsteer.sweep.report import write_report
    from dynsteer.sweep.summary import summary_csv_text
    from tests.report_check import check_report_shows_csv, layout

    cfg, res = synthetic_result(tmp_path)
    write_report(res, cfg)
    page = check_report_shows_csv(res.report_html.read_text(), summary_csv_text(cfg, res.summary))
    labels = [r["label"] for r in page.tables["variants"]]
    assert labels[:2] == ["unsteered", "scale=0, threshold=-1.23457"] and len(labels) == 13 + 9  # 9 controls
    assert labels[13] == "random: scale=2, threshold=-1.23457"
    assert page.tables["variants"][5]["max_relative_dose"] == "0.2558"  # 2·3/23.456789 = 0.255789...
    box = layout(res.report_html, tmp_path, width=1280)
    assert box["visible"] and 0 <= box["left"] < box["right"] <= 1280, box
    assert box["scroll_width"] <= 1280, box


def test_report_legends_sit_outside_the_data(tmp_path, monkeypatch):
    """Every legend of the report's plots lies right of its axes, never over the data."""
    import matplotlib

    matplotlib.use("Agg")
    from dynsteer.sweep import report

    figs = []
    monkeypatch.setattr(report, "_png", lambda fig: figs.append(fig) or "")
    cfg, res = synthetic_result(tmp_path)
    report.render_report(res, cfg)
    legends = 0
    for fig in figs:
        fig.canvas.draw()
        for ax in fig.axes:
            if (leg := ax.get_legend()) is not None:
                legends += 1
                assert leg.get_window_extent().x0 >= ax.get_window_extent().x1, ax.get_title()
    assert legends >= 2


def test_random_control_variants_same_norm_place_scale_and_gates():
    """Each steered variant gets a control: every added vector replaced by a seeded random direction of its norm,
    everything else (layer, site, tier, scale, monitors, gates) unchanged; none for a variant that adds nothing."""
    from dynsteer.sweep.control import random_control

    named = {"happy": np.linspace(-1.0, 2.0, H).astype(np.float32)}
    spec = SteeringSpec(vectors=[AddVector(layer=2, site="pre_attn", vector=3.0 * np.eye(H)[1], scale=1.0,
                                           tier="decode"), AddVector(layer=3, vector="happy", scale=0.5)])
    cfg = SweepConfig.build(spec, grid=["vectors[0].scale=0,2,4"], prompts=["x"], control_seed=5)
    norms = {(2, "pre_attn"): 10.0, (3, "post_block"): 20.0}
    variants = make_variants(cfg, norms, named)
    assert [v.id for v in variants] == ["v000", "v001", "v002", "v003", "r001", "r002", "r003"]
    assert [v.label for v in variants[4:]] == ["random: scale=0", "random: scale=2", "random: scale=4"]
    by = {v.id: v for v in variants}
    for vid in ("v001", "v002", "v003"):
        v, c = by[vid], by["r" + vid[1:]]
        assert c.control_of == vid and c.point == v.point and c.error is None
        for e, r in zip(v.spec.vectors, c.spec.vectors):
            want = np.asarray(named["happy"] if isinstance(e.vector, str) else e.vector, np.float64)
            got = np.asarray(r.vector, np.float64)
            assert np.linalg.norm(got) == pytest.approx(np.linalg.norm(want), rel=1e-6, abs=0)  # float32 storage
            assert abs(got @ want) / (np.linalg.norm(got) * np.linalg.norm(want)) < 0.99  # another direction
            assert (r.layer, r.site, r.tier, r.scale) == (e.layer, e.site, e.tier, e.scale)
        assert [d.dose for d in c.doses] == pytest.approx([d.dose for d in v.doses], rel=1e-6)
    # one direction per entry for the whole sweep; a seed fixes it; another seed gives another
    assert np.array_equal(by["r002"].spec.vectors[0].vector, by["r003"].spec.vectors[0].vector)
    again = make_variants(cfg, norms, named)[5].spec
    assert all(np.array_equal(a.vector, b.vector) for a, b in zip(again.vectors, by["r002"].spec.vectors))
    other = make_variants(cfg.model_copy(update={"control_seed": 6}), norms, named)[5].spec
    assert not np.array_equal(other.vectors[0].vector, by["r002"].spec.vectors[0].vector)
    # a policy's control keeps its monitor (gate) and controller, replacing only the added vector
    pol = make_variants(SweepConfig.build(policy(), grid=["rules[0].actions[0].scale=0,3"], prompts=["x"]),
                        {(2, "post_block"): 20.0})
    assert [v.id for v in pol] == ["v000", "v001", "v002", "r002"]  # scale 0 adds nothing: no control
    ctl, steered = pol[3].policy, pol[2].policy
    assert ctl.monitors == steered.monitors and ctl.controller == steered.controller
    assert ctl.rules[0].actions[0].scale == 3.0
    assert np.linalg.norm(ctl.rules[0].actions[0].vector.astype(np.float64)) == pytest.approx(3.0, rel=1e-6)
    assert np.array_equal(random_control(steered, 0).rules[0].actions[0].vector, ctl.rules[0].actions[0].vector)
    # switched off: no controls, and the fingerprint a sweep had before controls existed (seed irrelevant)
    off = cfg.model_copy(update={"random_control": False})
    assert [v.id for v in make_variants(off, norms, named)] == ["v000", "v001", "v002", "v003"]
    assert off.fingerprint() == off.model_copy(update={"control_seed": 0}).fingerprint() != cfg.fingerprint()
    assert cfg.fingerprint() != cfg.model_copy(update={"control_seed": 0}).fingerprint()
    # a vector name the engine lacks: the control keeps the error, the sweep goes on
    missing = make_variants(cfg, None, None)
    assert missing[4].id == "r001" and "unknown vector name 'happy'" in missing[4].error


def test_quality_columns_against_the_baseline():
    """concept_gain, perplexity_ratio, relevance and its ratio, combined: per class, against the baseline's row."""
    from dynsteer.sweep.quality import combined_score, pareto_front
    from dynsteer.sweep.summary import QUALITY_COLUMNS, summary_columns

    assert M.prompt_overlap("The soup was cold and late.", "Cold soup? Sorry!") == pytest.approx(2 / 3)
    assert M.prompt_overlap("the and of", "anything") is None and M.prompt_overlap("cold soup", "") == 0.0
    assert pareto_front([1.0, 2.0, 1.5], [0.0, 0.5, 0.6]) == [0, 2]
    spec = SteeringSpec(vectors=[AddVector(layer=2, vector=np.eye(H)[1], scale=1.0)])
    cfg = SweepConfig.build(spec, grid=["vectors[0].scale=2"], prompts=[{"prompt": "cold soup late", "label": "t"}],
                            words=("great",))
    variants = make_variants(cfg, {(2, "post_block"): 20.0})
    assert [v.id for v in variants] == ["v000", "v001", "r001"]
    texts = {"v000": "cold soup, sorry", "v001": "great great soup", "r001": "noise noise noise"}
    vals = {"v000": (0.1, 4.0, 0.0), "v001": (0.5, 6.0, 0.25), "r001": (0.0, 8.0, 0.5)}
    recs = [{"variant": vid, "prompt_index": 0, "label": "t", "changed": vid != "v000", "identical": vid == "v000",
             "fired": None, "text": texts[vid], "concept_words": vals[vid][0], "perplexity": vals[vid][1],
             "repeat_4gram": vals[vid][2]} for vid in texts]
    assert set(QUALITY_COLUMNS) | {"relevance", "control_of"} <= set(summary_columns(cfg))
    rows = {r["variant"]: r for r in summarize(cfg, variants, recs) if r["class"] == "all"}
    assert rows["v000"]["relevance"] == "0.666667" and rows["v001"]["relevance"] == "0.333333"  # cold, soup / soup
    assert rows["r001"]["relevance"] == "0" and rows["r001"]["control_of"] == "v001"
    assert float(rows["v001"]["concept_gain"]) == pytest.approx(0.4)
    assert float(rows["v001"]["perplexity_ratio"]) == pytest.approx(1.5)
    assert float(rows["v001"]["relevance_ratio"]) == pytest.approx(0.5)
    assert float(rows["v001"]["combined"]) == pytest.approx(0.4 / 1.5 * 0.75 * 0.5, rel=1e-5)
    assert float(rows["v001"]["combined"]) == pytest.approx(combined_score(0.4, 1.5, 0.25, 0.5), rel=1e-5)
    assert float(rows["r001"]["concept_gain"]) == pytest.approx(-0.1) and rows["r001"]["combined"] == "0"
    assert rows["v000"]["concept_gain"] == "0" and rows["v000"]["perplexity_ratio"] == "1"


def test_report_pareto_plot_and_controls_table(tmp_path):
    """The report opens its plots with concept gain vs perplexity ratio (steered, random controls, front) and shows
    each variant's figures beside its control's, as in the CSV; per-metric plots leave the controls out."""
    import base64
    import io

    from PIL import Image

    from dynsteer.sweep.report import write_report
    from dynsteer.sweep.summary import summary_csv_text
    from tests.report_check import Tables, check_report_shows_csv

    cfg, res = synthetic_result(tmp_path)
    write_report(res, cfg)
    page = check_report_shows_csv(res.report_html.read_text(), summary_csv_text(cfg, res.summary))
    names = [n for n, _ in page.images]
    assert names[0] == "pareto" and "metric-combined" in names
    img = Image.open(io.BytesIO(base64.b64decode(dict(page.images)["pareto"].split(",", 1)[1])))
    px = np.asarray(img.convert("RGB"), np.int64)
    # the control markers' red (matplotlib C3) and the steered markers' blue (C0) are both drawn
    assert ((abs(px - [214, 39, 40]).sum(axis=2) < 30).sum() > 50 and
            (abs(px - [31, 119, 180]).sum(axis=2) < 30).sum() > 50)
    rows = {r["variant"]: r for r in res.summary if r["class"] == "all"}
    controls = Tables(res.report_html.read_text()).tables["controls"]
    assert [r["_variant"] for r in controls] == [f"v{i:03d}" for i in range(4, 13)]
    for r in controls:
        for m in ("concept_gain", "perplexity_ratio", "relevance_ratio", "combined"):
            assert r[f"{m}:steered"] == short(rows[r["_variant"]][m])
            assert r[f"{m}:random"] == short(rows["r" + r["_variant"][1:]][m])
    off = cfg.model_copy(update={"random_control": False})
    res.variants = make_variants(off, {(2, "post_block"): 23.456789})
    res.records = [r for r in res.records if not r["variant"].startswith("r")]
    res.summary = summarize(off, res.variants, res.records)
    write_report(res, off)
    text = res.report_html.read_text()
    assert 'id="controls"' not in text and "random:" not in text.split("<h2>Metric definitions")[0]
