"""benchmarks/lib/pyspy.py: reading py-spy's raw stacks per thread, the summary a report carries, and the sampler
attached to a live process tree (where py-spy is installed and may attach)."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from lib.pyspy import Sampler, read_raw, summary  # noqa: E402

RAW = textwrap.dedent("""\
    thread (11): MainThread;step (vllm/v1/engine/core.py:400);plan (dynsteer/steering/runtime.py:420);_gather (dynsteer/steering/runtime.py:450) 6
    thread (11);step (vllm/v1/engine/core.py:400);execute (vllm/v1/worker/gpu_model_runner.py:90) 10
    thread (11);step (vllm/v1/engine/core.py:400);plan (dynsteer/steering/runtime.py:420) 4
    thread (22): dynsteer-spool;_run (dynsteer/capture/spool.py:164);_write (dynsteer/capture/spool.py:218) 5
    thread (33);wait (threading.py:300) 5
    thread (44): api;serve (dynsteer/engine/server.py:389);run (uvicorn/main.py:1);handle (vllm/entrypoints/api.py:5) 3
    thread (44);serve (dynsteer/engine/server.py:389);handle (vllm/entrypoints/api.py:5);hook (dynsteer/engine/frontend.py:9) 1
    not a stack line
""")


def test_raw_stacks_are_read_per_named_thread(tmp_path: Path) -> None:
    path = tmp_path / "core.txt"
    path.write_text(RAW)
    threads = read_raw(path)
    assert set(threads) == {"MainThread", "dynsteer-spool", "thread 33", "api"}  # a name seen once names the thread
    assert sum(threads["MainThread"].values()) == 20
    gz = tmp_path / "core.txt.gz"
    with gzip.open(gz, "wt") as f:
        f.write(RAW)
    assert read_raw(gz) == threads


def test_summary_shares_and_innermost_dynsteer_frames_below_vllm(tmp_path: Path) -> None:
    path = tmp_path / "core.txt"
    path.write_text(RAW)
    s = summary(path, top=2)
    assert s["samples"] == 34
    assert list(s["threads"]) == ["MainThread", "dynsteer-spool", "thread 33", "api"]  # busiest first
    main = s["threads"]["MainThread"]
    assert main["share"] == pytest.approx(20 / 34, abs=1e-4)
    assert main["focus_share"] == pytest.approx(10 / 20)
    # the innermost dynsteer frame of each stack: _gather (6) and plan (4); the vLLM-only stack has none
    assert main["top_focus"] == [["_gather (dynsteer/steering/runtime.py:450)", 0.3],
                                 ["plan (dynsteer/steering/runtime.py:420)", 0.2]]
    assert main["top_leaves"][0] == ["execute (vllm/v1/worker/gpu_model_runner.py:90)", 0.5]
    assert s["threads"]["thread 33"]["focus_share"] == 0.0
    # an entry point above vLLM's frames is not time in dynsteer; a hook vLLM calls is
    api = s["threads"]["api"]
    assert api["focus_share"] == 0.25
    assert api["top_focus"] == [["hook (dynsteer/engine/frontend.py:9)", 0.25]]


def _py_spy() -> str | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return exe if os.access(exe, os.X_OK) else None


@pytest.mark.skipif(_py_spy() is None, reason="py-spy is not installed")
def test_sampler_profiles_a_process_and_its_child(tmp_path: Path) -> None:
    # a parent and a child spinning in a function each: both sampled, raw files gzipped, summaries returned
    code = textwrap.dedent("""\
        import subprocess, sys, time
        def parent_spin():
            t = time.time()
            while time.time() - t < 30:
                sum(range(1000))
        if len(sys.argv) > 1:
            def child_spin():
                t = time.time()
                while time.time() - t < 30:
                    sum(range(1000))
            child_spin()
        else:
            subprocess.Popen([sys.executable, __file__, "child"])
            parent_spin()
    """)
    script = tmp_path / "spin.py"
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        time.sleep(1.0)  # the child is up
        sampler = Sampler(_py_spy(), tmp_path / "out", rate=100)
        sampler.start(proc.pid, "spin")
        time.sleep(1.5)
        out = sampler.stop()
    finally:
        import psutil

        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait()
    if not out:
        pytest.skip("py-spy may not attach here (ptrace not permitted)")
    assert len(out) == 2 and all(name.startswith("spin-") for name in out)
    spins = {frame.split(" (")[0] for s in out.values() for t in s["threads"].values() for frame, _ in t["top_leaves"]}
    assert {"parent_spin", "child_spin"} <= spins
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == sorted(name + ".gz" for name in out)  # raw files gzipped, nothing else left


def test_sampler_modes_are_py_spy_flags(tmp_path):
    out = tmp_path / "x.txt"
    busy, idle, gil = (Sampler("py-spy", tmp_path, rate=50, mode=m).command(7, out) for m in ("busy", "idle", "gil"))
    assert busy == ["py-spy", "record", "-p", "7", "-f", "raw", "--threads", "-r", "50", "-o", str(out)]
    assert idle == busy[:7] + ["--idle"] + busy[7:] and gil == busy[:7] + ["--gil"] + busy[7:]
    with pytest.raises(ValueError, match="py-spy mode"):
        Sampler("py-spy", tmp_path, mode="wall")
