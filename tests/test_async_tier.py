"""The async tier on a real CPU engine: activation streams to a monitor in another process, its commands back.

A monitor process watches the ``resid`` stream (layer 1, generated tokens of requests tagged ``target*``), fires on
the first probe crossing and sends a command. The targeted request's tokens change from the step the ack names on;
every other request is byte-identical to an unmonitored run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import dynsteer
from dynsteer import steer_params
from dynsteer.capture.spec import CaptureSpec
from dynsteer.config import DynsteerConfig, MonitorConfig, StreamSpec
from tests.stream_collector import StreamCollector
from tests.conftest import make_llm, token_ids

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning"]
MAX_TOKENS = 160  # long after the probe first crosses (tokens 6-20): room for a monitor process on a loaded machine
SCRIPT = Path(__file__).with_name("monitor_script.py")


def _config() -> DynsteerConfig:
    mon = MonitorConfig.private(streams={
        "resid": StreamSpec(places=("1.post_block",), requests="tagged", tag_prefix="target"),
        # the same rows as bfloat16: 2 bytes per value on the wire
        "resid16": StreamSpec(places=("1.post_block",), requests="tagged", tag_prefix="target", dtype="bfloat16")})
    return DynsteerConfig(capture_sites=("post_block",), capture_layers=(1,), monitor=mon)


def _params():
    from vllm import SamplingParams

    base = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [steer_params(base, None, tag="target-0"), base, base]


@pytest.fixture(scope="module", params=["in-process", "multiprocess"])
def engine(request, tiny_llama_path):
    """The fast in-process engine, and vLLM's default layout (engine core in its own process)."""
    import os

    cfg = _config()
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if request.param == "multiprocess" else "0"
    try:
        with make_llm(tiny_llama_path, **cfg.engine_kwargs()) as llm:
            yield llm, cfg
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


@pytest.fixture(scope="module")
def baseline(engine):
    """Unmonitored outputs, the stream's frames of the same run and the target's capture."""
    llm, cfg = engine
    st = dynsteer.attach(llm)
    st.set_capture(CaptureSpec(layers=(1,), positions="all_generated"))
    col = StreamCollector(cfg)
    col.start()
    time.sleep(0.5)  # subscribed before the run starts
    outs = llm.generate(PROMPTS, _params())
    frames = col.finish(expect=MAX_TOKENS - 1)
    st.set_capture(None)
    capture = st.take_captures(["target-0"])["target-0"]
    return token_ids(outs), frames, capture, outs[0].prompt_token_ids


def test_stream_frames_hold_the_target_rows_once_in_order_and_equal_its_capture(baseline):
    base, frames, capture, prompt = baseline
    assert frames, "no frame arrived"
    seqs = [f.seq for f in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous, in order
    steps = [f.step for f in frames]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # one message per step
    assert all(len(f.req_ids) == 1 for f in frames)  # only the tagged request
    positions = np.concatenate([f.positions for f in frames])
    values = np.concatenate([f.values["1.post_block"] for f in frames])
    n = len(prompt)
    np.testing.assert_array_equal(positions, np.arange(n, n + MAX_TOKENS - 1))
    np.testing.assert_array_equal(capture.positions, positions)
    np.testing.assert_array_equal(capture.arrays[(1, "post_block")], values)


def test_a_bfloat16_stream_travels_as_16_bits_and_reaches_the_monitor_as_the_rounded_float32_rows(engine, monkeypatch):
    """The bfloat16 stream's arrays on the wire are 2 bytes per value; the frames' values are exactly the float32
    stream's rows rounded to bfloat16, at the same positions."""
    import torch

    from dynsteer.monitor.client import StreamFrame

    llm, cfg = engine
    wire: dict[str, set] = {"resid": set(), "resid16": set()}
    from_wire = StreamFrame.from_wire.__func__

    def recording(cls, raw):
        wire[raw.stream] |= {(a.dtype.str, a.itemsize) for a in raw.arrays[2:]}
        return from_wire(cls, raw)

    monkeypatch.setattr(StreamFrame, "from_wire", classmethod(recording))
    col = StreamCollector(cfg, name="bf16-sub", streams=("resid", "resid16"))
    col.start()
    time.sleep(0.5)
    llm.generate(PROMPTS, _params())
    frames = col.finish(expect=2 * (MAX_TOKENS - 1))
    by = {name: [f for f in frames if f.stream == name] for name in ("resid", "resid16")}
    assert wire["resid"] == {("<f4", 4)} and wire["resid16"] == {("<i2", 2)}
    assert all(f.dtype == "bfloat16" for f in by["resid16"]) and all(f.dtype == "float32" for f in by["resid"])
    full = np.concatenate([f.values["1.post_block"] for f in by["resid"]])
    half = np.concatenate([f.values["1.post_block"] for f in by["resid16"]])
    assert full.shape == half.shape == (MAX_TOKENS - 1, full.shape[1]) and half.dtype == np.float32
    np.testing.assert_array_equal(np.concatenate([f.positions for f in by["resid16"]]),
                                  np.concatenate([f.positions for f in by["resid"]]))
    rounded = torch.from_numpy(full).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(half, rounded)
    if llm.llm_engine.model_config.dtype == torch.float32:  # (a bfloat16 model's rows are bfloat16 numbers already)
        assert not np.array_equal(half, full)  # rounding happened: the test sees the difference


def _probe_for(frames, prompt_len: int) -> tuple[np.ndarray, float, int]:
    """A unit probe and threshold whose first crossing on the baseline falls mid-generation."""
    values = np.concatenate([f.values["1.post_block"] for f in frames])
    for seed in range(200):
        probe = np.random.default_rng(seed).standard_normal(values.shape[1]).astype(np.float32)
        probe /= np.linalg.norm(probe)
        scores = values @ probe
        thr = float(scores[:6].max()) + 1e-3
        later = np.flatnonzero(scores[6:20] > thr)
        if later.size:
            return probe, thr, 6 + int(later[0])
    raise AssertionError("no probe crosses mid-generation")


def _run_monitored(engine, baseline, action: str, tmp_path: Path):
    llm, cfg = engine
    base, frames, _, prompt = baseline
    probe, thr, _ = _probe_for(frames, len(prompt))
    np.save(tmp_path / "probe.npy", probe)
    vec = np.random.default_rng(7).standard_normal(probe.size).astype(np.float32) * 8
    np.save(tmp_path / "vec.npy", vec)
    log = tmp_path / f"{action}.jsonl"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), cfg.monitor.endpoint, cfg.monitor.command_endpoint,
                             str(tmp_path / "probe.npy"), repr(thr), action, str(log), str(tmp_path / "vec.npy")],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        outs = llm.generate(PROMPTS, _params())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and '"ack"' not in log.read_text():
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    acks = [l for l in lines if "ack" in l]
    assert len(acks) == 1, lines[-3:]
    return outs, acks[0], [l for l in lines if "ack" not in l], len(prompt)


def test_a_monitor_process_steers_the_flagged_request_from_the_acked_step(engine, baseline, tmp_path):
    outs, ack, frames, n = _run_monitored(engine, baseline, "steer", tmp_path)
    base = baseline[0]
    assert ack["ack"]["status"] == "applied", ack
    step = ack["ack"]["step"]
    fired_at = next(f for f in frames if f["seq"] == ack["at_seq"])
    assert fired_at["step"] < step
    # the first position computed at or after the acked step: tokens sampled from there on may differ
    first = min(p for f in frames if f["step"] >= step for p in f["positions"])
    k0 = first - n + 1
    got = token_ids(outs)
    assert got[0][:k0] == base[0][:k0]
    assert got[0][k0:] != base[0][k0:]
    assert got[1:] == base[1:]  # byte-identical: the other requests


def test_a_monitor_process_aborts_the_flagged_request(engine, baseline, tmp_path):
    outs, ack, frames, n = _run_monitored(engine, baseline, "abort", tmp_path)
    base = baseline[0]
    assert ack["ack"]["status"] == "applied", ack
    got = token_ids(outs)
    assert outs[0].outputs[0].finish_reason == "abort"
    assert "probe-mon" in str(outs[0].outputs[0].stop_reason) and "probe crossed" in str(outs[0].outputs[0].stop_reason)
    assert 0 < len(got[0]) < MAX_TOKENS and got[0] == base[0][:len(got[0])]
    assert got[1:] == base[1:]


def test_fuzzed_command_messages_during_generation_change_nothing(engine, baseline):
    """Garbage, truncated and ill-typed commands (and valid ones naming no live request) sent while the engine
    generates: every one is answered with a rejection naming a field; every output is byte-identical."""
    import msgspec
    import zmq

    llm, cfg = engine
    base = baseline[0]
    rng = np.random.default_rng(0)
    valid = msgspec.msgpack.encode({"id": "x", "monitor": "fz", "command": {"op": "abort", "request": "r"}})
    messages = []
    for i in range(400):
        kind = i % 4
        if kind == 0:
            messages.append(rng.bytes(int(rng.integers(0, 64))))
        elif kind == 1:
            messages.append(valid[: int(rng.integers(0, len(valid)))])
        elif kind == 2:
            obj = {"id": f"f{i}", "monitor": "fz", "command": {
                "op": str(rng.choice(["abort", "steer", "threshold", "rule", "?"])), "request": f"nope-{i}",
                "rule": int(rng.integers(-3, 80)), "enabled": bool(rng.integers(0, 2)),
                "threshold": float(rng.choice([np.nan, np.inf, 1.0])), "monitor": "m",
                "spec": {"vectors": [{"layer": int(rng.integers(-2, 9)), "vector": "nope", "tier": "prefill"}]}}}
            messages.append(msgspec.msgpack.encode(obj))
        else:
            messages.append(msgspec.msgpack.encode({"id": f"f{i}", "monitor": "fz",
                                                    "command": {"op": "abort", "request": f"nope-{i}"}}))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(cfg.monitor.command_endpoint)
    replies = []

    def blast() -> None:
        time.sleep(0.05)
        for m in messages:
            sock.send(m)
        deadline = time.monotonic() + 20
        while len(replies) < len(messages) and time.monotonic() < deadline:
            if sock.poll(100):
                replies.append(msgspec.msgpack.decode(sock.recv()))

    t = threading.Thread(target=blast)
    t.start()
    outs = llm.generate(PROMPTS, _params())
    while t.is_alive():  # keep the engine stepping until every message was answered
        llm.generate(PROMPTS[:1], _params()[:1])
    t.join()
    sock.close(0)
    assert token_ids(outs) == base
    assert len(replies) == len(messages)
    assert all(r["status"] == "rejected" and ":" in r["error"] for r in replies)
    heads = {r["error"].split(":", 1)[0].split(".")[0].split("[")[0] for r in replies}
    assert heads <= {"message", "command", "id", "monitor", "v"}, heads


def test_the_engine_core_runs_where_the_mode_says(engine):
    llm, _ = engine
    inproc = hasattr(llm.llm_engine.engine_core, "engine_core")  # InprocClient holds the EngineCore itself
    import os

    assert inproc == (os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0")


def test_stream_accounting_is_exported_as_prometheus_metrics(engine):
    """The frontend process (where vLLM serves /metrics) exports the hub's per-subscriber accounting."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    llm, cfg = engine
    col = StreamCollector(cfg, name="metrics-sub")
    col.start()
    time.sleep(0.5)
    llm.generate(PROMPTS, _params())
    deadline = time.monotonic() + 10
    while sum(len(f.positions) for f in col.frames) < MAX_TOKENS - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    values: dict[str, float] = {}
    up = None
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in fam.samples:
            if sample.labels.get("endpoint") != cfg.monitor.endpoint:
                continue
            if sample.name == "dynsteer_stream_hub_up":
                up = sample.value
            if sample.labels.get("subscriber") == "metrics-sub" and sample.labels.get("stream") == "resid":
                values[sample.name.removesuffix("_total")] = sample.value  # counters: _total
    col.finish(expect=0)
    assert up == 1.0
    n = {k.removeprefix("dynsteer_stream_"): v for k, v in values.items()}
    assert n["published"] >= MAX_TOKENS - 1 - 1  # one message per decode step of the tagged request
    assert n["published"] == n["delivered"] + n["dropped"] + n["spilled"] + n["pending"]
    assert n["dropped"] == 0


def test_a_sigkilled_monitor_loses_nothing_the_engine_serves_on_and_a_restart_resumes_without_gaps(
        engine, baseline, tmp_path):
    import os
    import signal

    from dynsteer.streams.metrics import StreamMetricsCollector

    llm, cfg = engine
    base = baseline[0]
    np.save(tmp_path / "probe.npy", np.zeros(128, np.float32))
    env = dict(os.environ, MONITOR_NAME="killed-mon", MONITOR_DELAY_S="0.02")

    def start(log: Path, extra: dict) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), cfg.monitor.endpoint, cfg.monitor.command_endpoint,
                                 str(tmp_path / "probe.npy"), "0", "none", str(log)], stdout=subprocess.PIPE,
                                text=True, cwd=Path(__file__).parents[1], env={**env, **extra})
        assert proc.stdout.readline().strip() == "ready"
        return proc

    first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    proc = start(first_log, {})
    time.sleep(0.5)

    def kill_midway() -> None:
        while first_log.read_text().count("\n") < 5:
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_midway)
    killer.start()
    outs = llm.generate(PROMPTS, _params())
    killer.join()
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert token_ids(outs) == base  # the engine served on, unchanged
    seen = [json.loads(line)["seq"] for line in first_log.read_text().splitlines() if line.strip().endswith("}")]
    assert 5 <= len(seen) < MAX_TOKENS - 1  # killed mid-run (it reads 20 ms per frame)
    resumed = start(second_log, {"MONITOR_RESUME": str(seen[-1] + 1), "MONITOR_DELAY_S": "0"})
    want = MAX_TOKENS - 1 - len(seen)
    deadline = time.monotonic() + 30
    while second_log.read_text().count("\n") < want and time.monotonic() < deadline:
        time.sleep(0.02)
    # while it is registered (it says bye on exit), once its acks reached the hub
    while True:
        stats = StreamMetricsCollector().query(cfg.monitor.endpoint)
        held = stats["resid"]["subscribers"].get("killed-mon")
        if held is None or held["pending"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    resumed.wait(timeout=60)  # it exits after 5 s without a frame
    rest = [json.loads(line)["seq"] for line in second_log.read_text().splitlines()]
    got = seen + rest
    assert got == list(range(seen[0], seen[0] + MAX_TOKENS - 1))  # every message of the run, once, in order
    c = stats["resid"]["subscribers"]["killed-mon"]
    assert c["published"] == c["delivered"] + c["dropped"] + c["spilled"] + c["pending"]
    assert c["dropped"] == 0 and c["pending"] == 0
