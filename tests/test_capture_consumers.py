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


def test_zmq_consumer_sends_records_and_streamed_chunks_and_a_missing_receiver_only_marks_partial(tiny_llama_path):
    import numpy as np
    import zmq
    from vllm import SamplingParams

    from dynsteer.capture.zmq_consumer import receive_capture

    ctx = zmq.Context.instance()
    whole, live = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    whole_port = whole.bind_to_random_port("tcp://127.0.0.1")
    live_port = live.bind_to_random_port("tcp://127.0.0.1")
    probe = ctx.socket(zmq.PULL)  # a port nobody listens on: bound, then closed
    dead_port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    cfg = DynsteerConfig(capture_sites=("pre_attn", "post_block"), capture_consumers={
        "memory": {},
        "zmq": {"endpoint": f"tcp://127.0.0.1:{whole_port}"},
        "live": {"kind": "zmq", "endpoint": f"tcp://127.0.0.1:{live_port}", "stream": True},
        "nobody": {"kind": "zmq", "endpoint": f"tcp://127.0.0.1:{dead_port}"}})
    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompts = ["the quick brown fox", "once upon a time"]
    spec = CaptureSpec(layers=(1, 3), sites=("pre_attn", "post_block"), positions="all",
                       consumers=("memory", "zmq", "live"))
    try:
        with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
            st = dynsteer.attach(llm)
            base = token_ids(llm.generate(prompts, params))
            outs = st.generate(prompts, params, capture=spec)
            assert token_ids(outs) == base
            got = {}
            for _ in prompts:
                assert whole.poll(10_000), "no record message"
                kind, cap = receive_capture(whole)
                assert kind == "record" and cap.status == "ok"
                got[cap.tag] = cap
            chunks: dict[str, list] = {}
            ended = set()
            while len(ended) < len(prompts):
                assert live.poll(10_000), "no streamed message"
                kind, cap = receive_capture(live)
                if kind == "record":
                    assert not cap.arrays and cap.positions.size == 0  # the chunks came first
                    ended.add(cap.tag)
                else:
                    assert cap.tag not in ended
                    chunks.setdefault(cap.tag, []).append(cap)
            for out in outs:
                want = out.capture
                assert set(got[want.tag].arrays) == set(want.arrays) == set(spec.places())
                np.testing.assert_array_equal(got[want.tag].positions, want.positions)
                parts = chunks[want.tag]
                assert len(parts) >= 2  # prefill, then decode steps
                pos = np.concatenate([c.positions for c in parts])
                order = np.argsort(pos)
                np.testing.assert_array_equal(pos[order], want.positions)
                for place, arr in want.arrays.items():
                    np.testing.assert_array_equal(got[want.tag][place], arr)
                    np.testing.assert_array_equal(np.concatenate([c[place] for c in parts])[order], arr)
            # No receiver: the send fails at once, generation is untouched, the data stays with the caller.
            lost = st.generate(prompts, params, capture=CaptureSpec(layers=(1,), consumers=("nobody",)))
            assert token_ids(lost) == base
            for out in lost:
                assert out.capture.status == "partial" and "zmq consumer" in out.capture.errors[0]
                assert out.capture[(1, "post_block")].shape == (1, st.hidden_size)  # last_prompt: one row
    finally:
        whole.close(linger=0)
        live.close(linger=0)
