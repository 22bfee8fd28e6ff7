"""Dose recommendation on the tiny model: the chosen dose keeps the bounds on the tuning split (re-measured), the
search stops at the first dose that breaks one, a random direction of equal norm is measured beside every step, and
the held-out figures come from held-out prompts only, after the choice."""

from __future__ import annotations

import numpy as np
import pytest

import dynsteer
from dynsteer import DynsteerConfig
from dynsteer.sweep.dose_search import recommend_dose
from dynsteer.sweep.quality import combined_score, measure, probe_concept, prompt_ids, word_concept
from tests.conftest import make_llm

LAYER = 1
TUNE = ["the cat sat on", "a dog ran to", "we went to the", "it was a very", "she said that the"]
HELD = ["one day the man", "in the morning they", "he looked at the"]
DOSES = (0.05, 0.2, 1.0, 4.0, 16.0)


class Spy:
    """The steerer, recording the prompts of every ``generate`` call (generation, probe and norm reads alike)."""

    def __init__(self, steerer):
        self._st, self.calls = steerer, []

    def generate(self, inputs, *args, **kwargs):
        self.calls.append([tuple(i["prompt_token_ids"]) if isinstance(i, dict) else i for i in inputs])
        return self._st.generate(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._st, name)


@pytest.fixture(scope="module")
def rig(tiny_llama_path, tmp_path_factory):
    from dynsteer.probes import LogisticProbe, collect

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DYNSTEER_CACHE", str(tmp_path_factory.mktemp("cache")))
        cfg = DynsteerConfig(capture_sites=("post_block",), capture_layers=(LAYER,))
        with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
            st = dynsteer.attach(llm)
            a = ["the cat is happy", "a good day", "we love the sun", "it was great", "a nice walk", "so kind"]
            b = ["the dog is sad", "a bad night", "we hate the rain", "it was awful", "a cold wind", "so cruel"]
            y = np.array([1] * len(a) + [0] * len(b))
            probe = LogisticProbe().fit(collect(st, a + b, y, layers=[LAYER], progress=False).X[LAYER], y)
            yield {"st": st, "probe": probe, "vector": np.asarray(probe.coef_[0], np.float64)}


def test_chosen_dose_keeps_the_bounds_and_held_out_comes_after(rig):
    spy = Spy(rig["st"])
    concept = probe_concept(spy, rig["probe"], layer=LAYER, chat=False)
    rec = recommend_dose(spy, rig["vector"], layer=LAYER, tune_prompts=TUNE, held_prompts=HELD, concept=concept,
                         doses=DOSES, max_tokens=12, chat=False, max_repeat_4gram=1.0)
    base = rec.tune_unsteered
    assert rec.dose is not None and rec.scale is not None
    assert rec.scale == pytest.approx(rec.dose * rec.mean_norm / rec.vector_norm)
    chosen = next(i for i, s in enumerate(rec.steps) if s.steered.dose == rec.dose)
    # every step up to the chosen one keeps the bounds; the search stopped at the first that broke one
    for s in rec.steps[:chosen + 1]:
        assert s.admissible and s.steered.perplexity <= 1.5 * base.perplexity
    assert chosen < len(rec.steps) - 1, "the grid reaches doses that wreck the tiny model: some step must fail"
    last = rec.steps[-1]
    assert not last.admissible and last.steered.perplexity > 1.5 * base.perplexity
    assert len(rec.steps) == chosen + 2
    # re-measured independently, the recommended dose keeps the bound on the tuning split (greedy: same replies)
    again = measure(rig["st"], TUNE, concept, vector=rig["vector"], layer=LAYER, scale=rec.scale, max_tokens=12,
                    chat=False)
    assert again.replies == rec.steps[chosen].steered.replies
    assert again.perplexity <= 1.5 * base.perplexity
    # the random control: same scale and dose at every step, a different direction, which does steer
    for s in rec.steps:
        assert (s.random.scale, s.random.dose) == (s.steered.scale, s.steered.dose)
    assert last.random.replies != last.steered.replies and last.random.replies != base.replies
    # held-out: measured on the held-out prompts only, and only after every tuning-split generation
    tune_ids = {tuple(p) for p in prompt_ids(rig["st"], TUNE, chat=False)}
    held_ids = {tuple(p) for p in prompt_ids(rig["st"], HELD, chat=False)}
    kinds = ["tune" if set(c) == tune_ids else "held" if set(c) == held_ids else "read" for c in spy.calls]
    assert kinds.count("tune") == 1 + 2 * len(rec.steps) and kinds.count("held") == 3
    assert max(i for i, k in enumerate(kinds) if k == "tune") < min(i for i, k in enumerate(kinds) if k == "held")
    for hp in (rec.held_unsteered, rec.held_steered, rec.held_random):
        assert hp.prompts == HELD
    assert rec.held_steered.scale == rec.held_random.scale == rec.scale
    assert rec.held_steered.replies != rec.held_random.replies


def test_repeat_bound_rejects_and_nothing_admissible_gives_no_dose(rig):
    concept = word_concept(["the"])
    first = measure(rig["st"], TUNE, concept, vector=rig["vector"], layer=LAYER, max_tokens=12, chat=False)
    rec = recommend_dose(rig["st"], rig["vector"], layer=LAYER, tune_prompts=TUNE, held_prompts=HELD, concept=concept,
                         doses=(16.0,), max_tokens=12, chat=False, max_perplexity_ratio=1e9, max_repeat_4gram=-1.0)
    assert rec.dose is None and rec.held_steered is None and len(rec.steps) == 1
    assert rec.steps[0].reasons and "repeated 4-grams" in rec.steps[0].reasons[0]
    assert rec.tune_unsteered.replies == first.replies  # scale 0: unsteered


def test_bad_splits_and_doses_name_the_argument():
    with pytest.raises(ValueError, match="held_prompts"):
        recommend_dose(None, np.ones(4), layer=0, tune_prompts=["a", "b"], held_prompts=["b"], concept=word_concept([]))
    with pytest.raises(ValueError, match="doses"):
        recommend_dose(None, np.ones(4), layer=0, tune_prompts=["a"], held_prompts=["b"], concept=word_concept([]),
                       doses=(0.2, 0.1))
    assert combined_score(0.2, 0.5, 0.0) == pytest.approx(0.2)  # more fluent than unsteered: no bonus


def test_cli_recommends_on_a_split_and_writes_json(rig, tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    import dynsteer.cli.vector as cli_vector
    from dynsteer.cli.app import app
    from dynsteer.cli.dose import split_prompts

    monkeypatch.setattr(cli_vector, "make_engine", lambda *a, **k: rig["st"].llm)
    monkeypatch.setattr("dynsteer.cli.engine.shutdown_engine", lambda llm: None)  # the shared engine lives on
    np.save(tmp_path / "v.npy", rig["vector"].astype(np.float32))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in TUNE + HELD))
    args = ["dose", "recommend", "tiny", "--vector", str(tmp_path / "v.npy"), "--layer", str(LAYER),
            "--prompts", str(tmp_path / "p.jsonl"), "--words", "the", "--doses", "0.05,16", "--max-tokens", "8",
            "--max-repeat-4gram", "1", "--out", str(tmp_path / "r.json")]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "r.json").read_text())
    tune, held = split_prompts(TUNE + HELD, 0.5, 0)
    assert data["tune_unsteered"]["prompts"] == tune and data["held_steered"]["prompts"] == held
    assert not set(tune) & set(held) and sorted(tune + held) == sorted(TUNE + HELD)
    assert data["dose"] == 0.05 and "recommended: dose 0.05" in res.output
    bad = CliRunner().invoke(app, args[:-2] + ["--held-out", "1.5"])
    assert bad.exit_code != 0 and "--held-out" in bad.output
