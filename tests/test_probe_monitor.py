"""run_probe_monitor (what `dynsteer monitor` runs): flags exactly the requests whose probe decision crosses the
threshold, once each, with the chosen command; rejected commands are counted, not fatal, and retried at the request's next crossing."""

from __future__ import annotations

import numpy as np
import pytest

from dynsteer.commands import CommandAck
from dynsteer.monitor.client import CommandError, StreamFrame
from dynsteer.monitor.probe_monitor import run_probe_monitor
from dynsteer.probefile.fileformat import load_probe, save_probe


class _FakeMonitor:
    def __init__(self, frames, reject=()):
        self._frames, self.reject, self.calls, self.reasons = list(frames), set(reject), [], []

    def recv(self, timeout_s=None):
        return self._frames.pop(0) if self._frames else None

    def frames(self, timeout_s=None):
        while self._frames:
            yield self._frames.pop(0)

    def _ack(self, op, req):
        self.calls.append((op, req))
        if req in self.reject:
            raise CommandError(CommandAck(id="x", status="rejected", error="command.request: no live request"))
        return CommandAck(id="x", status="applied", step=len(self.calls))

    def abort(self, req, reason=""):
        self.reasons.append(reason)
        return self._ack("abort", req)

    def steer(self, req, spec):
        return self._ack("steer", req)


def test_flags_each_crossing_request_once(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(16)
    save_probe(tmp_path / "p.safetensors", w, bias=-1.0, model_id="tiny", layer=3, site="post_block")
    probe = load_probe(tmp_path / "p.safetensors")
    wl, b = probe.linear_form()
    frames, expected = [], set()
    for step in range(6):
        values = rng.standard_normal((4, 16)).astype(np.float32)
        ids = [f"r{step % 3}", f"r{step % 3 + 3}"]
        request = np.array([0, 0, 1, 1], np.int32)
        decision = values.astype(np.float64) @ wl + b
        expected |= {ids[i] for i in np.unique(request[decision > 0])}
        frames.append(StreamFrame("resid", step, step, ids, request, np.arange(4), {"3.post_block": values}))
    assert "r4" in expected and len(expected) >= 3  # the seed gives crossings, one of them rejected
    mon = _FakeMonitor(frames, reject={"r4"})
    stats = run_probe_monitor(mon, probe, action="abort")
    assert set(stats.flagged) == expected - {"r4"}
    called = [r for _, r in mon.calls]
    assert sorted(r for r in called if r != "r4") == sorted(expected - {"r4"})  # one command per flagged request
    assert stats.rejected == called.count("r4") >= 1  # a rejected one is tried again on its next crossing
    assert stats.frames == 6 and stats.rows == 24


def test_target_class_zero_flags_the_other_side_and_reasons_name_probe_score_not_path(tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal(16)
    path = tmp_path / "deep" / "dir" / "sentiment.safetensors"
    path.parent.mkdir(parents=True)
    save_probe(path, w, bias=0.0, model_id=str(tmp_path / "models" / "secret-model-path"), layer=3, site="post_block")
    probe = load_probe(path)
    wl, b = probe.linear_form()
    values = rng.standard_normal((6, 16)).astype(np.float32)
    decision = values.astype(np.float64) @ wl + b
    ids = [f"r{i}" for i in range(6)]
    frame = StreamFrame("resid", 0, 0, ids, np.arange(6, dtype=np.int32), np.arange(6), {"3.post_block": values})
    negatives = {ids[i] for i in range(6) if decision[i] < 0}
    assert 0 < len(negatives) < 6
    mon = _FakeMonitor([frame])
    stats = run_probe_monitor(mon, probe, action="abort", target_class=0, probe_name="sentiment")
    assert set(stats.flagged) == negatives  # class 0: the side whose decision value is below 0
    for (_, req), reason in zip(mon.calls, mon.reasons):
        i = ids.index(req)
        assert reason.startswith("sentiment at 3.post_block scored ") and f"{-decision[i]:.3f}" in reason
        assert "class 0" in reason and str(tmp_path) not in reason and "secret" not in reason
    with np.testing.assert_raises(ValueError):
        run_probe_monitor(_FakeMonitor([]), probe, target_class=2)


def test_the_first_frame_has_its_own_wait():
    calls = []

    class _Slow(_FakeMonitor):
        def recv(self, timeout_s=None):
            calls.append(timeout_s)
            return super().recv(timeout_s)

        def frames(self, timeout_s=None):
            while (f := self.recv(timeout_s)) is not None:
                yield f

    frames = [StreamFrame("resid", s, s, [], np.zeros(0, np.int32), np.zeros(0), {}) for s in range(3)]
    mon = _Slow(frames)
    rng = np.random.default_rng(0)
    stats = run_probe_monitor(mon, _probe_stub(rng), timeout_s=2.0, start_timeout_s=None)
    assert stats.frames == 3 and calls == [None, 2.0, 2.0, 2.0]  # first: unbounded; then idle time from the last


def _probe_stub(rng):
    class _P:
        layer, site = 3, "post_block"

        class meta:
            calibration = None

        def linear_form(self):
            return rng.standard_normal(16), 0.0

    return _P()


def test_steer_then_abort_above_a_higher_score(tmp_path):
    """--action steer --abort-above: a crossing request is steered once; if it later scores above the higher mark
    it is aborted once, with a reason naming the probe and the score; one that stays below is only steered."""
    w = np.zeros(4)
    w[0] = 1.0
    save_probe(tmp_path / "p.safetensors", w, bias=0.0, model_id="tiny", layer=2, site="post_block")
    probe = load_probe(tmp_path / "p.safetensors")
    wl, b = probe.linear_form()

    def frame(step, x_a, x_b):  # rows of requests a and b, one each; the score is monotone in x
        values = np.zeros((2, 4), np.float32)
        values[:, 0] = [x_a, x_b]
        return StreamFrame("resid", step, step, ["a", "b"], np.array([0, 1], np.int32), np.arange(2),
                           {"2.post_block": values})

    def x_for(score):  # the feature value at which the probe's decision equals score
        return (score - b) / wl[0]

    frames = [frame(0, x_for(-1), x_for(-1)), frame(1, x_for(1), x_for(1)), frame(2, x_for(2), x_for(5)),
              frame(3, x_for(6), x_for(6)), frame(4, x_for(7), x_for(7))]
    mon = _FakeMonitor(frames)
    stats = run_probe_monitor(mon, probe, action="steer", steer_spec=object(), threshold=0.0, abort_above=4.0)
    assert mon.calls == [("steer", "a"), ("steer", "b"), ("abort", "b"), ("abort", "a")]
    assert set(stats.flagged) == {"a", "b"} and list(stats.aborted) == ["b", "a"]
    assert "after steering" in mon.reasons[0] and "scored 5.000" in mon.reasons[0] and "/" not in mon.reasons[0]
    assert "then aborted: b, a" in stats.summary()
    with pytest.raises(ValueError, match="abort_above"):
        run_probe_monitor(_FakeMonitor([]), probe, action="abort", abort_above=1.0)
