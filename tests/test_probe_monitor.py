"""run_probe_monitor (what `dynsteer monitor` runs): flags exactly the requests whose probe decision crosses the
threshold, once each, with the chosen command; rejected commands are counted, not fatal, and retried at the request's next crossing."""

from __future__ import annotations

import numpy as np

from dynsteer.commands import CommandAck
from dynsteer.monitor.client import CommandError, StreamFrame
from dynsteer.monitor.probe_monitor import run_probe_monitor
from dynsteer.probefile.fileformat import load_probe, save_probe


class _FakeMonitor:
    def __init__(self, frames, reject=()):
        self._frames, self.reject, self.calls = frames, set(reject), []

    def frames(self, timeout_s=None):
        yield from self._frames

    def _ack(self, op, req):
        self.calls.append((op, req))
        if req in self.reject:
            raise CommandError(CommandAck(id="x", status="rejected", error="command.request: no live request"))
        return CommandAck(id="x", status="applied", step=len(self.calls))

    def abort(self, req, reason=""):
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
