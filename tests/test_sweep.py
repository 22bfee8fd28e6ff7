"""``dynsteer sweep`` on SmolLM2-135M-Instruct: scale × threshold over labelled prompts, one shared engine.

The policy is the dynamic-sentiment example's (a sentiment probe gates positive steering on P(negative)). Checks:
the JSONL / CSV / HTML outputs, that the report's numbers are the CSV's and the CSV's are the samples', that every
plot decodes to a non-blank image, that headless Chromium renders a non-blank page, that an interrupted sweep resumes
without regenerating finished samples, that a second run is byte-identical, the relative dose and its guardrail,
and the CLI.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dynsteer
from dynsteer import AddVector, DynamicSteeringPolicy, DynsteerConfig, SteeringSpec, SteeringValidationError
from dynsteer.sweep import SweepConfig, SweepInterrupted, run_sweep
from dynsteer.sweep import metrics as M
from tests.conftest import console_script, make_llm, token_ids
from tests.report_check import CHROMIUM, Tables, check_report_shows_csv, layout, screenshot
from tests.test_sweep_units import example_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import dynamic_sentiment as ds  # noqa: E402

OUTPUTS = ("samples.jsonl", "summary.csv", "report.html")
PROMPTS = [{"prompt": ds.COMPLAINTS[0], "label": "complaint"}, {"prompt": ds.PRAISE[1], "label": "praise"},
           {"prompt": ds.COMPLAINTS[2], "label": "complaint"}, {"prompt": ds.PRAISE[2], "label": "praise"}]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """One SmolLM2 engine for the module, the sentiment probe trained on it, and a fresh norm cache."""
    from dynsteer.zoo import smollm2

    model = smollm2()
    work = tmp_path_factory.mktemp("sweep")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DYNSTEER_CACHE", str(work / "cache"))
        cfg = DynsteerConfig(capture_sites=("post_block",), capture_layers=(ds.LAYER,), max_gates=2)
        with make_llm(model, max_model_len=512, **cfg.engine_kwargs()) as llm:
            steerer = dynsteer.attach(llm)
            probe = work / "sentiment.safetensors"
            ds.train_probe(steerer, probe)
            policy = ds.sentiment_policy(probe)
            (work / "policy.yaml").write_text(policy.to_yaml())
            prompts = work / "prompts.jsonl"
            prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
            yield {"steerer": steerer, "llm": llm, "probe": probe, "policy": policy, "work": work,
                   "prompts": prompts, "model": model}


def sweep_config(rig, **kw) -> SweepConfig:
    m = rig["policy"].resolved().monitors[0]
    thresholds = f"{m.threshold!r},{m.threshold + 3.0 / m.sharpness!r}"
    grid = kw.pop("grid", ["rules[0].actions[0].scale=0.5,1.0", f"monitors[0].threshold={thresholds}"])
    return SweepConfig.build(DynamicSteeringPolicy.from_yaml((rig["work"] / "policy.yaml").read_text()), grid=grid,
                             prompts=rig["prompts"], max_tokens=20, target_class="complaint",
                             probe_file=rig["probe"], concept_class=1, words=("great", "love", "terrible"),
                             batch_size=6, **kw)


@pytest.fixture(scope="module")
def first_run(rig):
    import time

    t0 = time.perf_counter()
    res = run_sweep(sweep_config(rig), rig["steerer"], rig["work"] / "run-a", progress=False)
    res.seconds = time.perf_counter() - t0
    return res


def test_sweep_outputs_and_report_numbers(rig, first_run):
    res, out = first_run, first_run.out_dir
    print(f"sweep of 36 samples took {res.seconds:.1f} s")
    assert all((out / f).is_file() for f in OUTPUTS)
    assert res.generated == 4 * 9 and res.skipped == 0  # 4 prompts × (baseline + 2×2 grid + 4 random controls)
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len({r["id"] for r in records}) == 36 and all(r["variant"] == "v000" for r in records[:4])
    rows = list(csv.DictReader(io.StringIO((out / "summary.csv").read_text())))
    assert len(rows) == 9 * 3  # variants × (complaint, praise, all)

    # the CSV's figures are the samples' means (metrics recomputed from the tokens)
    for r in records:
        assert r["repeat_4gram"] == M.repeated_ngram_rate(r["token_ids"], 4)
        assert r["distinct_2"] == M.distinct_n(r["token_ids"], 2)
        assert r["perplexity"] is not None and 1.0 <= r["perplexity"] < 1e3
        assert len(r["probe_trace"]) == len(r["token_ids"]) - 1  # every generated token but the last
        assert r["concept_probe"] == pytest.approx(np.mean(r["probe_trace"]))
        assert r["relevance"] == M.prompt_overlap(PROMPTS[r["prompt_index"]]["prompt"], r["text"])
    for row in rows:
        sel = [r for r in records if r["variant"] == row["variant"] and row["class"] in (r["label"], "all")]
        assert int(row["n"]) == len(sel)
        for m in ("concept_probe", "perplexity", "distinct_1", "repeat_4gram", "relevance"):
            assert float(row[m]) == pytest.approx(np.mean([r[m] for r in sel]), rel=1e-5), (row["variant"], m)
        assert float(row["changed_rate"]) == pytest.approx(np.mean([r["changed"] for r in sel]))
    base = {r["class"]: r for r in rows if r["variant"] == "v000"}
    assert base["all"]["identical_rate"] == "1" and base["all"]["changed_rate"] == "0"
    assert float(base["praise"]["concept_probe"]) > float(base["complaint"]["concept_probe"])  # the probe works
    # the strongest variant (scale 1, threshold at the probe's boundary) steers complaints and leaves praise alone
    strong = {r["class"]: r for r in rows if r["variant"] == "v003"}
    assert strong["all"]["rules[0].actions[0].scale"] == "1" and float(strong["complaint"]["changed_rate"]) > 0
    assert strong["all"]["side_effect_identical_rate"] == "1" and float(strong["all"]["selectivity"]) > 0
    assert float(strong["complaint"]["fire_rate"]) > 0 and float(strong["praise"]["fire_rate"]) == 0
    assert float(strong["complaint"]["concept_probe"]) > float(base["complaint"]["concept_probe"])
    # relative dose: |scale|·‖v‖ / mean‖h‖ with the cached norm
    norm_files = list((rig["work"] / "cache" / "residual_norms").glob("*.json"))
    assert len(norm_files) == 1
    mean_h = json.loads(norm_files[0].read_text())["norms"][f"{ds.LAYER}.post_block"]
    assert 10 < mean_h < 1e4
    vnorm = np.linalg.norm(np.asarray(rig["policy"].rules[0].actions[0].vector, np.float64))
    for scale, variant in ((0.5, "v001"), (1.0, "v003")):
        row = next(r for r in rows if r["variant"] == variant)
        assert float(row["max_relative_dose"]) == pytest.approx(scale * vnorm / mean_h, rel=1e-5)

    # quality against the baseline of the same class
    for row in rows:
        b = base[row["class"]]
        assert float(row["concept_gain"]) == pytest.approx(float(row["concept_probe"]) - float(b["concept_probe"]),
                                                           abs=2e-6)
        assert float(row["perplexity_ratio"]) == pytest.approx(float(row["perplexity"]) / float(b["perplexity"]),
                                                               rel=2e-5)
        assert row["combined"] != "" and row["relevance_ratio"] != ""

    # each steered variant's random control: the same gates and dose, a random direction of the same norm
    by_id = {v.id: v for v in res.variants}
    assert [v.id for v in res.variants[5:]] == ["r001", "r002", "r003", "r004"]
    for c in res.variants[5:]:
        v = by_id[c.control_of]
        assert c.label == f"random: {v.label}" and c.policy.monitors == v.policy.monitors
        got, want = (np.asarray(x.policy.rules[0].actions[0].vector, np.float64) for x in (c, v))
        assert np.linalg.norm(got) == pytest.approx(np.linalg.norm(want), rel=1e-6)
        assert abs(got @ want) / np.linalg.norm(got) ** 2 < 0.2  # another direction (576 dimensions)
        assert c.policy.rules[0].actions[0].scale == v.policy.rules[0].actions[0].scale
        assert c.doses[0].dose == pytest.approx(v.doses[0].dose, rel=1e-6)
    # ... does less: the sentiment direction raises P(positive) on complaints more than a random push of its size
    ctl = {r["class"]: r for r in rows if r["variant"] == "r003"}
    assert float(strong["complaint"]["concept_gain"]) > float(ctl["complaint"]["concept_gain"]) + 0.05
    assert float(strong["all"]["combined"]) > float(ctl["all"]["combined"])

    for r in records:  # the dose actually applied: the variant's dose wherever the gate (× dyn_scale) was 1
        if r["variant"] == "v003":
            assert max(r["dose_trace"]) <= float(strong["all"]["max_relative_dose"]) * (1 + 1e-5)
            assert (max(r["dose_trace"]) > 0) == r["fired"]

    # the report shows the CSV's values (to 4 significant digits), variants named by their grid values
    page = check_report_shows_csv((out / "report.html").read_text(), (out / "summary.csv").read_text())
    assert page.tables["variants"][3]["label"] == f"scale=1, threshold={float(rows[3 * 3]['monitors[0].threshold']):g}"
    names = [name for name, _ in page.images]
    assert page.tables["controls"][2]["concept_gain:random"] == page.tables["variants"][7]["concept_gain"]
    assert {"pareto", "metric-concept_probe", "metric-perplexity", "metric-repeat_4gram", "metric-distinct_2",
            "gate-fire-rate", "probe-traces"} <= set(names), names
    from PIL import Image

    for name, src in page.images:
        assert src.startswith("data:image/png;base64,"), name
        img = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
        img.load()
        px = np.asarray(img.convert("L"), np.float64)
        assert img.width > 100 and img.height > 100 and px.std() > 5, name
    assert "http://" not in (out / "report.html").read_text() and "https://" not in (out / "report.html").read_text()


def test_sweep_is_reproducible_byte_for_byte(rig, first_run):
    again = run_sweep(sweep_config(rig), rig["steerer"], rig["work"] / "run-b", progress=True)
    assert again.generated == 36
    for name in OUTPUTS:
        assert (again.out_dir / name).read_bytes() == (first_run.out_dir / name).read_bytes(), name


def test_sweep_resumes_after_interrupt(rig, first_run):
    out = rig["work"] / "run-c"

    def stop_after_first_batch(done, total):
        raise SweepInterrupted(f"stopped at {done}/{total}")

    with pytest.raises(SweepInterrupted):
        run_sweep(sweep_config(rig), rig["steerer"], out, progress=False, on_batch=stop_after_first_batch)
    assert len((out / "samples.jsonl").read_text().splitlines()) == 6  # one batch was saved
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"id": "v001/p0003/s000", "torn')  # a write torn by the interruption is dropped
    resumed = run_sweep(sweep_config(rig), rig["steerer"], out, progress=False)
    assert (resumed.skipped, resumed.generated) == (6, 30)
    for name in OUTPUTS:
        assert (out / name).read_bytes() == (first_run.out_dir / name).read_bytes(), name
    done = run_sweep(sweep_config(rig), rig["steerer"], out, progress=False)
    assert (done.skipped, done.generated) == (36, 0)
    from dynsteer.sweep import SweepMismatchError

    with pytest.raises(SweepMismatchError):
        run_sweep(sweep_config(rig, seed=1), rig["steerer"], out, progress=False)
    for other in ({"random_control": False}, {"control_seed": 1}):  # the control is part of the sweep
        with pytest.raises(SweepMismatchError):
            run_sweep(sweep_config(rig, **other), rig["steerer"], out, progress=False)
    # a sweep run without controls says how to resume it
    plain = rig["work"] / "run-plain"
    plain.mkdir()
    without = sweep_config(rig, random_control=False)
    (plain / "sweep.json").write_text(json.dumps({"fingerprint": without.fingerprint(),
                                                  "config": without.model_dump(mode="json")}))
    with pytest.raises(SweepMismatchError, match="no random controls: --no-random-control"):
        run_sweep(sweep_config(rig), rig["steerer"], plain, progress=False)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (the test command installs it: apt-get install "
                                               "chromium)")
def test_report_at_1280px_in_headless_chromium(first_run, tmp_path):
    """At a 1,280 px window the selectivity column is on screen and nothing overflows sideways; the page renders
    text and coloured plots."""
    box = layout(first_run.report_html, tmp_path, width=1280)
    assert box["visible"] and box["inner_width"] == 1280
    assert 0 <= box["left"] < box["right"] <= 1280, box
    assert box["scroll_width"] <= 1280, box  # wide tables scroll inside their own box, not the page
    from PIL import Image

    px = np.asarray(Image.open(screenshot(first_run.report_html, tmp_path, width=1280)).convert("RGB"), np.int64)
    assert px.shape[0] >= 1000 and px.shape[1] == 1280
    gray = px.mean(axis=2)
    assert gray.std() > 10 and (gray < 128).mean() > 0.005  # text and plots, not a blank page
    colors = len(np.unique(px.reshape(-1, 3)[::7], axis=0))
    assert colors > 50, colors  # plot lines in colour, not one flat fill


def test_relative_dose_guardrail_rejects_or_clips(rig, monkeypatch):
    from vllm import SamplingParams

    import dynsteer.dose as dose_mod
    from dynsteer.dose import residual_norms

    st = rig["steerer"]
    policy = rig["policy"].resolved()
    mean_h = residual_norms(st, [(ds.LAYER, "post_block")])[(ds.LAYER, "post_block")]
    # measured once per model: from now on (admission included) the cached norm is used
    monkeypatch.setattr(dose_mod, "measure_residual_norms", lambda *a, **k: pytest.fail("norms measured again"))
    assert residual_norms(st, [(ds.LAYER, "post_block")]) == {(ds.LAYER, "post_block"): mean_h}
    vnorm = float(np.linalg.norm(np.asarray(policy.rules[0].actions[0].vector, np.float64)))
    dose = vnorm / mean_h
    params = SamplingParams(temperature=0.0, max_tokens=8)
    conv = [[{"role": "user", "content": ds.COMPLAINTS[0]}]]
    def guarded(limit):
        return DynamicSteeringPolicy.model_validate({**policy.model_dump(), "max_relative_dose": limit})

    with pytest.raises(SteeringValidationError, match=r"rules\[0\]\.actions\[0\]\.scale: relative dose"):
        st.chat(conv, params, policy=guarded(dose / 2))  # a bare number: mode reject
    clip = guarded({"limit": dose / 2, "mode": "clip"})
    with pytest.warns(UserWarning, match="clipped from 1 to 0.5"):
        clipped = st.chat(conv, params, policy=clip)
    half = policy.model_copy(update={"rules": (policy.rules[0].model_copy(update={"actions": (
        policy.rules[0].actions[0].model_copy(update={"scale": 0.5}),)}),)})
    assert list(clipped[0].outputs[0].token_ids) == list(st.chat(conv, params, policy=half)[0].outputs[0].token_ids)
    st.chat(conv, params, policy=guarded(dose * 1.01))  # under the limit: admitted unchanged


def test_steerer_dose_limit_from_a_recommendation(rig, tmp_path):
    """Steerer.set_dose_limit: a recommendation file's dose becomes the max_relative_dose (clip) of every policy sent
    without its own, exactly as if the policy carried it; a policy's own limit wins; None removes it."""
    import warnings

    from vllm import SamplingParams

    from dynsteer.dose import residual_norms

    st = rig["steerer"]
    policy = rig["policy"].resolved()
    mean_h = residual_norms(st, [(ds.LAYER, "post_block")])[(ds.LAYER, "post_block")]
    dose = float(np.linalg.norm(np.asarray(policy.rules[0].actions[0].vector, np.float64))) / mean_h
    params = SamplingParams(temperature=0.0, max_tokens=8)
    conv = [[{"role": "user", "content": ds.COMPLAINTS[0]}]]
    half = policy.model_copy(update={"rules": (policy.rules[0].model_copy(update={"actions": (
        policy.rules[0].actions[0].model_copy(update={"scale": 0.5}),)}),)})
    rec = tmp_path / "rec.json"
    rec.write_text(json.dumps({"layer": ds.LAYER, "site": "post_block", "dose": dose / 2, "steps": []}))
    empty = tmp_path / "none.json"
    empty.write_text(json.dumps({"dose": None, "steps": []}))
    try:
        limit = st.set_dose_limit(rec)
        assert limit.limit == pytest.approx(dose / 2) and limit.mode == "clip"
        with pytest.warns(UserWarning, match="clipped from 1 to 0.5"):
            clipped = st.chat(conv, params, policy=policy)
        assert token_ids(clipped) == token_ids(st.chat(conv, params, policy=half))
        own = DynamicSteeringPolicy.model_validate({**policy.model_dump(), "max_relative_dose": dose * 2})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # its own, looser limit: admitted unchanged
            st.chat(conv, params, policy=own)
        with pytest.raises(ValueError, match="no dose"):
            st.set_dose_limit(empty)
        with pytest.raises(ValueError, match="not a dose recommendation file"):
            st.set_dose_limit(tmp_path / "missing.json")
        assert st.set_dose_limit(None) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            st.chat(conv, params, policy=policy)
    finally:
        st.set_dose_limit(None)


def test_spec_sweep_with_seeded_sampling(rig, monkeypatch):
    """A static steering spec, 2 sampled continuations per prompt: seeds pair every sample with its baseline; all
    variants go to the engine in one batch."""
    calls = []
    chat = rig["steerer"].chat
    monkeypatch.setattr(rig["steerer"], "chat",
                        lambda convs, *a, **k: calls.append(len(convs)) or chat(convs, *a, **k))
    vec = np.asarray(rig["policy"].resolved().rules[0].actions[0].vector, np.float32)
    spec = SteeringSpec(vectors=[AddVector(layer=ds.LAYER, vector=vec, scale=1.0, tier="decode")])
    cfg = SweepConfig.build(spec, grid=["vectors[0].scale=0.0,1.5"], prompts=rig["prompts"], samples=2, seed=7,
                            temperature=0.8, max_tokens=12, target_class="complaint", words=("the", "and"))
    res = run_sweep(cfg, rig["steerer"], rig["work"] / "spec", progress=False)
    # baseline, both variants and the scale-1.5 variant's random control (scale 0 has none): one generate call
    assert res.generated == 4 * 2 * 4 and calls == [32]
    assert [v.id for v in res.variants] == ["v000", "v001", "v002", "r002"]
    recs = {r["id"]: r for r in res.records}
    assert {r["seed"] for r in res.records} == {7, 8}
    base = [recs[f"v000/p{p:04d}/s{s:03d}"]["token_ids"] for p in range(4) for s in range(2)]
    assert any(base[i] != base[i + 1] for i in range(0, 8, 2))  # the two seeds sample differently
    rows = {(r["variant"], r["class"]): r for r in res.summary}
    assert rows[("v001", "all")]["identical_rate"] == "1"  # scale 0 with the same seeds: the baseline's samples
    assert float(rows[("v002", "all")]["changed_rate"]) > 0.5 and rows[("v002", "all")]["fire_rate"] == ""
    assert rows[("v001", "all")]["max_relative_dose"] == "0" and float(rows[("v002", "all")]["max_relative_dose"]) > 0
    assert rows[("v002", "all")]["concept_words"] != "" and rows[("v002", "all")]["concept_probe"] == ""
    page = check_report_shows_csv(res.report_html.read_text(), res.summary_csv.read_text())
    assert "metric-changed_rate" in [n for n, _ in page.images] and "gate-fire-rate" not in [n for n, _ in page.images]


def test_cli_sweep(rig, monkeypatch):
    from typer.testing import CliRunner

    import dynsteer.cli.sweep as cli_sweep
    from dynsteer.cli.app import app

    monkeypatch.setattr(cli_sweep, "make_engine", lambda *a, **k: rig["llm"])
    monkeypatch.setattr("dynsteer.cli.engine.shutdown_engine", lambda llm: None)  # the shared engine lives on
    out = rig["work"] / "cli"
    args = ["sweep", str(rig["work"] / "policy.yaml"), "--prompts", str(rig["prompts"]), "--out", str(out),
            "--grid", "rules[0].actions[0].scale=1.0", "--max-tokens", "12", "--target-class", "complaint",
            "--probe", str(rig["probe"]), "--model", str(rig["model"])]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "12 samples generated, 0 already done" in result.output  # baseline, scale 1, its random control
    assert len((out / "samples.jsonl").read_text().splitlines()) == 12
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "0 samples generated, 12 already done" in again.output
    off = CliRunner().invoke(app, [*args, "--no-random-control"])  # another sweep: refused in the same directory
    assert off.exit_code == 2 and "holds a different sweep" in " ".join(off.output.split())
    bad = CliRunner().invoke(app, [*args[:-2], "--grid", "rules[0].actions[9].scale=1"])
    assert bad.exit_code != 0


def test_example_runs_quietly_from_its_command_line(rig, tmp_path):
    """examples/sweeps/policy-gated.yaml's own command, run by the console script (engine core in its own process):
    vLLM's INFO logs stay out of the terminal, the report names variants by their values."""
    root = Path(__file__).resolve().parents[1]
    argv = example_command(root / "examples" / "sweeps" / "policy-gated.yaml")
    out = tmp_path / "out"
    argv += ["--out", str(out), "--max-tokens", "8", "--model", str(rig["model"]), "--dtype", "float32",
             "--max-model-len", "512", "--kv-cache-gb", "0.25", "--engine-arg", "max_num_seqs=16"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONPATH": str(root)}
    env.pop("VLLM_LOGGING_LEVEL", None)
    proc = subprocess.run([str(console_script()), *argv], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "54 samples generated, 0 already done" in output  # 6 prompts × (baseline + 2×2 grid + 4 controls)
    info = [ln for ln in output.splitlines() if " INFO " in ln or ln.startswith("INFO")]
    assert not info, info[:5]
    page = Tables((out / "report.html").read_text())
    assert [r["label"] for r in page.tables["variants"]] == [
        "unsteered", "scale=20, on=1", "scale=20, on=2", "scale=40, on=1", "scale=40, on=2", "random: scale=20, on=1",
        "random: scale=20, on=2", "random: scale=40, on=1", "random: scale=40, on=2"]
    assert "pareto" in [name for name, _ in page.images]
