"""Third-party capture consumers (entry points) and failure isolation: a failing consumer never aborts generation."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

import dynsteer
from dynsteer import CaptureSpec, DynsteerConfig
from tests.conftest import make_llm, token_ids

PLUGIN = textwrap.dedent('''
    import json, pathlib

    class Collect:
        """Writes one JSON line per finished capture."""
        def __init__(self, path):
            self.path = pathlib.Path(path)
        def on_finish(self, record):
            positions, arrays = record.arrays()
            with self.path.open("a") as f:
                f.write(json.dumps({"tag": record.tag, "n": len(positions),
                                    "sums": {f"{k[0]}.{k[1]}": float(v.sum()) for k, v in arrays.items()}}) + "\\n")

    class Boom:
        def __init__(self):
            pass
        def on_finish(self, record):
            raise RuntimeError("disk on fire")
''')


@pytest.fixture
def consumer_plugin(tmp_path, monkeypatch):
    """An installed-looking distribution that registers consumers under ``dynsteer.capture_consumers``."""
    site = tmp_path / "site"
    (site / "ds_test_consumers-0.1.dist-info").mkdir(parents=True)
    (site / "ds_test_consumers.py").write_text(PLUGIN)
    (site / "ds_test_consumers-0.1.dist-info" / "METADATA").write_text("Name: ds-test-consumers\nVersion: 0.1\n")
    (site / "ds_test_consumers-0.1.dist-info" / "entry_points.txt").write_text(
        "[dynsteer.capture_consumers]\ncollect = ds_test_consumers:Collect\nboom = ds_test_consumers:Boom\n")
    monkeypatch.syspath_prepend(str(site))
    yield tmp_path / "collected.jsonl"
    sys.modules.pop("ds_test_consumers", None)


def test_entry_point_consumer_receives_captures_and_a_failing_one_only_marks_partial(tiny_llama_path,
                                                                                    consumer_plugin):
    from vllm import SamplingParams

    cfg = DynsteerConfig(capture_sites=("post_block",), capture_consumers={
        "memory": {}, "collect": {"path": str(consumer_plugin)}, "boom": {}})
    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompts = ["the quick brown fox", "once upon a time"]
    with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        base = token_ids(llm.generate(prompts, params))
        good = st.generate(prompts, params, capture=CaptureSpec(layers=(1,), consumers=("memory", "collect")))
        lines = [json.loads(l) for l in consumer_plugin.read_text().splitlines()]
        assert sorted(l["tag"] for l in lines) == sorted(o.capture.tag for o in good)
        for out in good:
            line = next(l for l in lines if l["tag"] == out.capture.tag)
            assert line["sums"]["1.post_block"] == pytest.approx(float(out.capture[(1, "post_block")].sum()), rel=1e-5)
        bad = st.generate(prompts, params, capture=CaptureSpec(layers=(1,), positions="all",
                                                               consumers=("memory", "boom")))
        assert token_ids(bad) == base  # generation unaffected
        for out in bad:
            assert out.capture.status == "partial" and "disk on fire" in out.capture.errors[0]
            assert out.capture.positions.size > 0  # the data itself is complete
        lost = st.generate(prompts, params, capture=CaptureSpec(layers=(1,), consumers=("boom",)))
        assert all(o.capture is not None and o.capture.status == "partial" for o in lost)  # kept, not lost


def test_unknown_consumer_name_fails_at_engine_start(tiny_llama_path):
    cfg = DynsteerConfig(capture_sites=("post_block",), capture_consumers={"nope": {}})
    with pytest.raises(Exception, match="unknown capture consumer 'nope'"):
        with make_llm(tiny_llama_path, **cfg.engine_kwargs()):
            pass
