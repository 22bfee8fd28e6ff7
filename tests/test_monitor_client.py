"""The monitor side without an engine: the start handshake against a real hub (Python and HTTP), frames' start and
idle timeouts, user-visible request ids, and what the probe monitor prints."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest
import zmq

import dynsteer.monitor.client as client_module
from dynsteer.commands import user_request_id
from dynsteer.config import DynsteerConfig, MonitorConfig
from dynsteer.monitor.client import MonitorClient, StreamFrame
from dynsteer.monitor.probe_monitor import ProbeMonitorStats
from dynsteer.monitor.subscriber import StreamSubscriber
from dynsteer.spec import SteeringValidationError
from dynsteer.streams.hub import StreamHub
from dynsteer.streams.readiness import wait_for_subscribers

ROOT = Path(__file__).resolve().parents[1]
SUBSCRIBE = ("import sys, time\n"
             "from dynsteer.monitor.subscriber import StreamSubscriber\n"
             "sub = StreamSubscriber(sys.argv[1], 'proc-mon', ['resid'])\n"
             "while True:\n"
             "    sub.recv(0.2)\n")


@pytest.fixture
def hub() -> Iterator[tuple[StreamHub, MonitorConfig]]:
    mon = MonitorConfig.private()
    with StreamHub(mon.endpoint) as h:
        h.declare("resid", {"hidden": 4})
        yield h, mon


@pytest.fixture
def monitor_process(hub) -> Iterator[Any]:
    """``start()``: a monitor process subscribing to ``resid`` as ``proc-mon`` (killed after the test)."""
    procs: list[subprocess.Popen] = []

    def start() -> None:
        procs.append(subprocess.Popen([sys.executable, "-c", SUBSCRIBE, hub[1].endpoint], cwd=ROOT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)}))

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_the_wait_for_subscribers_times_out_naming_the_count_then_returns_once_a_monitor_process_subscribed(
        hub, monitor_process):
    h, mon = hub
    with pytest.raises(TimeoutError, match=r"^timeout_s: 0 of 1 subscribers connected to stream 'resid' after 0\.2 s "
                                           r"\(none\); start the monitors first"):
        wait_for_subscribers([mon.endpoint], "resid", n=1, timeout_s=0.2)
    monitor_process()  # it takes a few seconds to import and subscribe: the wait covers that
    assert wait_for_subscribers([mon.endpoint], "resid", n=1, timeout_s=60) == ["proc-mon"]
    with pytest.raises(TimeoutError, match=r"1 of 2 subscribers connected to stream 'resid' after 0\.3 s \(proc-mon\)"):
        wait_for_subscribers([mon.endpoint], "resid", n=2, timeout_s=0.3)
    with pytest.raises(LookupError, match=r"^name: no stream 'nope' on the engine's hub \(streams: resid\)"):
        wait_for_subscribers([mon.endpoint], "nope", timeout_s=1)
    with pytest.raises(SteeringValidationError, match="^min: a whole number >= 1, got 0"):
        wait_for_subscribers([mon.endpoint], "resid", n=0)
    with pytest.raises(SteeringValidationError, match="^timeout_s: between 0 and 600 seconds"):
        wait_for_subscribers([mon.endpoint], "resid", timeout_s=-1)


def _app(mon: MonitorConfig | None) -> Any:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from dynsteer.engine.keys import APP_STATE_ATTR
    from dynsteer.engine.server import SteeringEndpoints

    app = FastAPI()
    app.include_router(SteeringEndpoints(allow_remote=True).router())
    cfg = DynsteerConfig(monitor=mon) if mon is not None else DynsteerConfig(require=False)
    engine = SimpleNamespace(vllm_config=SimpleNamespace(additional_config=cfg.engine_kwargs()["additional_config"],
                                                         parallel_config=SimpleNamespace(pipeline_parallel_size=1)))
    setattr(app.state, APP_STATE_ATTR, {"engine": engine, "keys": []})
    return TestClient(app)


def test_the_subscribers_route_waits_for_min_and_names_what_is_wrong(hub, monitor_process):
    h, mon = hub
    http = _app(mon)
    monitor_process()
    url = "/v1/steering/streams/resid/subscribers"
    res = http.get(url, params={"min": 1, "timeout_s": 60})
    assert res.status_code == 200 and res.json() == {"stream": "resid", "subscribers": ["proc-mon"], "ready": True}
    res = http.get(url, params={"min": 2, "timeout_s": 0.2})
    assert res.status_code == 504
    assert res.json()["detail"].startswith("timeout_s: 1 of 2 subscribers connected to stream 'resid' after 0.2 s "
                                           "(proc-mon)")
    res = http.get("/v1/steering/streams/nope/subscribers")
    assert res.status_code == 404 and res.json()["detail"].startswith("name: no stream 'nope'")
    res = http.get(url, params={"min": 0})
    assert res.status_code == 400 and res.json()["detail"] == "min: a whole number >= 1, got 0"
    res = http.get(url, params={"timeout_s": 1e6})
    assert res.status_code == 400 and res.json()["detail"].startswith("timeout_s: between 0 and 600 seconds")
    res = _app(None).get(url)
    assert res.status_code == 400 and res.json()["detail"].startswith("monitor: this engine has no stream hub")


def test_a_frame_that_reached_the_socket_while_the_caller_was_busy_is_returned_at_a_zero_timeout(hub):
    h, mon = hub
    with StreamSubscriber(mon.endpoint, "busy", ["resid"]) as sub:
        h.publish("resid", {"step": 1, "req_ids": ["7-0123abcd"]}, [np.zeros(1, np.int32), np.zeros(1, np.int64)])
        # the caller busy with something else; the frame arrives meanwhile (waited for without reading it)
        assert sub._sock.poll(10_000, zmq.POLLIN)
        frame = sub.recv(0)
        assert frame is not None and frame.seq == 0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_frames_wait_for_the_first_one_then_count_idle_time_from_the_last(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(client_module, "time", clock)
    waits: list[float | None] = []
    queue = [_frame(s) for s in range(3)]

    def recv(timeout_s: float | None = None) -> Any:
        waits.append(None if timeout_s is None else round(timeout_s, 6))
        return queue.pop(0) if queue else None

    mon = MonitorClient.__new__(MonitorClient)
    mon.recv = recv  # type: ignore[method-assign]
    seen = []
    for frame in mon.frames(timeout_s=5.0, start_timeout_s=None):
        seen.append(frame.seq)
        clock.now += 2.0 if frame.seq == 0 else 7.0  # handling the frame took that long
    # first: no bound; after a 2 s handling, 3 s are left of 5; after 7 s none, but what came meanwhile is read
    assert seen == [0, 1, 2] and waits == [None, 3.0, 0.0, 0.0]
    waits.clear()
    queue[:] = [_frame(0)]
    assert [f.seq for f in mon.frames(timeout_s=5.0)] == [0] and waits == [5.0, 5.0]  # default start: timeout_s


def _frame(seq: int, ids: tuple[str, ...] = ()) -> StreamFrame:
    return StreamFrame("resid", seq, seq, list(ids), np.arange(len(ids), dtype=np.int32), np.zeros(len(ids)), {})


def test_frames_name_requests_as_vllm_outputs_do():
    assert user_request_id("32-bad6edaa") == "32"
    assert user_request_id("chatcmpl-9f1e-0123abcd") == "chatcmpl-9f1e"
    assert user_request_id("1_7-0123abcd") == "1_7"  # the second of n samples of request "7"
    assert user_request_id("7-ABCDEF12") == "7-ABCDEF12" and user_request_id("7") == "7"  # not vLLM's suffix
    frame = _frame(0, ("32-bad6edaa", "33-0123abcd"))
    assert frame.user_ids == ["32", "33"] and frame.user_id("33-0123abcd") == "33"
    assert frame.requests_where(np.array([False, True])) == ["33-0123abcd"]
    assert frame.requests_where(np.array([False, True]), user_ids=True) == ["33"]


def test_the_probe_monitor_summary_names_frames_commands_and_user_ids():
    stats = ProbeMonitorStats(frames=12, rows=30, flagged={"32-bad6edaa": 4, "1_7-0123abcd": 6}, rejected=1,
                              commands=3)
    assert stats.summary() == "12 frames, 30 rows; 3 commands (2 applied, 1 rejected); aborted: 32, 1_7"
    stats.action = "steer"
    assert stats.summary().endswith("steered: 32, 1_7")


def publish_once_subscribed(h: StreamHub, mon: MonitorConfig, row: np.ndarray, steps: int = 3) -> None:
    """In a thread: once a monitor is subscribed to ``resid``, one frame per step holding ``row`` of request
    ``9`` at place ``3.post_block``."""
    import threading

    def publish() -> None:
        wait_for_subscribers([mon.endpoint], "resid", timeout_s=60)
        for step in range(steps):
            h.publish("resid", {"step": step, "req_ids": ["9-0123abcd"], "places": ["3.post_block"]},
                      [np.zeros(1, np.int32), np.zeros(1, np.int64), row])

    threading.Thread(target=publish, daemon=True).start()


def test_the_safety_monitor_example_reports_as_frames_come_and_exits_with_a_summary(hub, tmp_path):
    """examples/safety_monitor.py as a user runs it: it says it subscribed, prints counts while frames come, stops
    once no frame came for ``--idle`` seconds and prints the summary."""
    from dynsteer.probefile.fileformat import save_probe

    h, mon = hub
    save_probe(tmp_path / "p.safetensors", np.ones(4), bias=-1e9, model_id="tiny", layer=3, site="post_block")

    publish_once_subscribed(h, mon, np.ones((1, 4), np.float32))
    example = ROOT / "examples" / "safety_monitor.py"
    proc = subprocess.run([sys.executable, str(example), str(tmp_path / "p.safetensors"), mon.endpoint,
                           mon.command_endpoint, "--idle", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "safety monitor: subscribed; waiting for the engine's first frame"
    assert lines[1] == "safety monitor: 1 frames, 0 commands"  # the first frame's progress line
    assert lines[-1] == "3 frames, 3 rows; 0 commands (0 applied, 0 rejected); aborted: none"


def test_the_monitor_cli_says_it_subscribed_prints_counts_while_frames_come_and_a_summary(hub, tmp_path):
    from typer.testing import CliRunner

    from dynsteer.cli.app import app
    from dynsteer.probefile.fileformat import save_probe

    h, mon = hub
    save_probe(tmp_path / "p.safetensors", np.ones(4), bias=0.0, model_id="tiny", layer=3, site="post_block")

    publish_once_subscribed(h, mon, np.zeros((1, 4), np.float32))
    res = CliRunner().invoke(app, ["monitor", str(tmp_path / "p.safetensors"), "--endpoint", mon.endpoint,
                                   "--command-endpoint", mon.command_endpoint, "--threshold", "1e9",
                                   "--start-timeout", "60", "--timeout", "2", "--progress-every", "0"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "monitor: subscribed to resid as 'probe-monitor'; waiting for the first frame (up to 60 s)" in lines
    assert [line for line in lines if line.startswith("monitor: ") and "frames" in line] == [
        f"monitor: {n} frames, 0 commands (0 applied, 0 rejected)" for n in (1, 2, 3)]
    assert lines[-1] == "3 frames, 3 rows; 0 commands (0 applied, 0 rejected); aborted: none"


def test_a_bfloat16_frame_is_widened_exactly_and_float32_rows_of_such_a_frame_pass_unchanged():
    """bfloat16 numbers given as their 16 bits become the float32 numbers they are; an engine that sent float32 rows
    under a bfloat16 header (the older form) is read as it was."""
    import torch

    rng = np.random.default_rng(0)
    rounded = torch.from_numpy(rng.standard_normal((3, 8)).astype(np.float32)).to(torch.bfloat16)
    bits = rounded.view(torch.int16).numpy()
    meta = {"step": 4, "req_ids": ["r"], "places": ["1.post_block"], "dtype": "bfloat16"}
    index, positions = np.zeros(3, np.int32), np.arange(3, dtype=np.int64)
    frame = StreamFrame.from_wire(SimpleNamespace(stream="s", seq=0, meta=meta, arrays=[index, positions, bits]))
    values = frame.values["1.post_block"]
    assert values.dtype == np.float32 and frame.dtype == "bfloat16"
    np.testing.assert_array_equal(values, rounded.to(torch.float32).numpy())
    widened = rounded.to(torch.float32).numpy()
    old = StreamFrame.from_wire(SimpleNamespace(stream="s", seq=0, meta=meta, arrays=[index, positions, widened]))
    assert old.values["1.post_block"] is widened
