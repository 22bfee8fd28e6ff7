"""``dynsteer doctor``: passes on CPU with the tiny model and prints its report; its checks fail when steering is
broken; ``dynsteer --version``."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dynsteer.cli import doctor
from dynsteer.spec import ModelShape
from tests.conftest import ON_GPU, console_script


EXE = console_script()
CHECKS = ("hooked", "steering fires", "batchmates untouched", "clear restores baseline", "prefix cache",
          "decode cost")


@pytest.mark.skipif(ON_GPU, reason="the CPU run; on a GPU run `dynsteer doctor` by hand")
def test_doctor_passes_on_cpu_and_prints_its_report(tiny_llama_path):
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as a user runs it: engine core in its own process
    proc = subprocess.run([str(EXE), "doctor", str(tiny_llama_path), "--max-overhead", "3"], env=env,
                          capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if "│" in line]
    for name in CHECKS:
        assert any(name in row and "PASS" in row for row in rows), name
    assert "FAIL" not in proc.stdout and "all checks passed" in proc.stdout
    # progress: each step as it starts and as it ends, with its time (before the report's table)
    lines = proc.stdout.splitlines()
    assert f"… starting vLLM on {Path(tiny_llama_path).name} (1-2 min on CPU, longer for a larger model)" in lines
    for name in CHECKS:
        start = lines.index(f"… check: {name}")
        assert re.fullmatch(rf"✓ check: {name}: PASS in \d+\.\d s", lines[start + 1]), lines[start + 1]
    # what dynsteer overrides in vLLM, in this process, the engine core's and the worker's
    assert "vLLM attributes dynsteer overrides" in proc.stdout
    for attribute, where in (("InputProcessor.process_inputs", "frontend"), ("Scheduler.schedule", "engine core"),
                             ("EngineCore.collective_rpc", "engine core"), ("GPUModelRunner.sample_tokens", "worker"),
                             ("LlamaDecoderLayer.forward", "worker"), ("WorkerWrapperBase.dynsteer_patches", "worker")):
        assert any(attribute in row and where in row for row in proc.stdout.splitlines()), (attribute, where)
    assert "INFO" not in proc.stdout  # vLLM's logs went to the log file
    log = proc.stdout.rsplit("vLLM's log:", 1)[1].split(")")[0].split()
    assert Path("".join(log)).read_text().count("INFO") > 0


class _Broken:
    """A steerer whose engine ignores steering and has no prefix cache: every behavioural check must fail."""

    shape = ModelShape(num_layers=4, hidden_size=16, architecture="Fake")

    def describe(self):
        return [{"rows_total": 63}]

    def generate(self, prompts, params, steering=None, use_tqdm=False):
        n = 1 if isinstance(prompts, str) else len(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2, 3])], num_cached_tokens=0)] * n

    def set_layer_vector(self, *a, **k):
        pass

    def clear_all(self):
        pass


def test_doctor_checks_fail_when_steering_does_nothing():
    checks = {c.name: c for c in doctor._checks(None, _Broken(), max_overhead=1e9)}
    assert checks["hooked"].ok
    for name in ("steering fires", "batchmates untouched", "clear restores baseline", "prefix cache"):
        assert not checks[name].ok, checks[name]
    assert "cached tokens" in checks["prefix cache"].detail


def test_doctor_lists_the_overrides_of_every_process():
    from rich.console import Console

    from dynsteer.engine import keys, patching

    class Owner:
        def method(self):
            pass

    def wrapper(self):
        pass

    step = {"owner": "vllm.x.core.Engine", "name": "step", "function": "dynsteer.engine.y.step", "why": "w",
            "kind": "replaced"}
    hasher = {"owner": "vllm.x.utils", "name": "block_hash", "function": "dynsteer.engine.z.hash", "why": "h",
              "kind": "replaced"}
    replies = [{keys.PATCHES_WORKER: [step], keys.PATCHES_ENGINE_CORE: [step, hasher]}, {keys.PATCHES_WORKER: []}]

    class LLM:
        def collective_rpc(self, method, args=()):
            assert method == keys.RPC_PATCHES
            return replies  # one per rank: rank 0's is listed

    patching.patch(Owner, "method", wrapper, why="frontend override")
    try:
        # the same override in the engine core's process too (both imported the module it patches)
        replies[0][keys.PATCHES_ENGINE_CORE].append(
            next(r for r in patching.applied_json() if r["why"] == "frontend override"))
        listed = doctor.patches(LLM())
    finally:
        patching.restore(Owner, "method")
    ours = next(p for p in listed if p.why == "frontend override")
    assert ours.where == ["frontend", "engine core"] and ours.owner.endswith("Owner") and ours.name == "method"
    assert ours.function.endswith("test_doctor_lists_the_overrides_of_every_process.<locals>.wrapper")
    engine_step = next(p for p in listed if p.name == "step")
    assert engine_step.where == ["worker", "engine core"] and engine_step.kind == "replaced"
    console = Console(record=True, width=240)  # wide enough that no cell folds: the rows are read whole
    console.print(doctor.patch_table(listed))
    lines = console.export_text().splitlines()
    assert any(f"overrides ({len(listed)})" in line for line in lines)
    # rows of the fakes (real overrides made by earlier tests in this process may be listed too)
    row = next(line for line in lines if "vllm.x.core" in line)  # Class.attribute, its module beside it
    assert "Engine.step" in row and "worker, engine core" in row
    row = next(line for line in lines if "vllm.x.utils" in line)  # a module's function
    assert "block_hash" in row and "engine core" in row


def test_version_option():
    out = subprocess.run([str(EXE), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("dynsteer ") and "vLLM 0.26" in out.stdout


def test_demo_score_and_verbose_flag():
    from typer.testing import CliRunner

    from dynsteer.cli.app import app
    from dynsteer.cli.demo import sentiment_score

    assert sentiment_score(["What a wonderful, happy day!", "Nothing here."]) == pytest.approx(100 * 2 / 7)
    assert sentiment_score(["Awful and sad, the worst."]) == pytest.approx(-100 * 3 / 5)
    assert sentiment_score([""]) == 0.0
    res = CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--verbose" in res.output


def test_demo_says_what_it_is_doing_before_each_long_step(monkeypatch, tmp_path):
    """The demo's steps (vector, engine start, generation) print a line as they start and end; the heavy parts are
    stand-ins here (the real run is ``scripts/demo.sh``)."""
    import io

    import vllm
    from rich.console import Console

    import dynsteer
    from dynsteer.cli import demo

    class _Steerer:
        def register_vector(self, name, vec):
            pass

        def chat(self, batch, params, steering=None, use_tqdm=False):
            return [SimpleNamespace(outputs=[SimpleNamespace(text="a happy day")]) for _ in batch]

    monkeypatch.setattr(demo, "contrastive_vector", lambda model, layer: np.ones(4, np.float32))
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: object())
    monkeypatch.setattr(dynsteer, "attach", lambda llm: _Steerer())
    out = io.StringIO()
    demo._demo(Console(file=out, width=200), tmp_path, layer=3, scale=1.0, max_tokens=8)
    lines = out.getvalue().splitlines()
    assert "… starting vLLM (first run ~3 min on CPU: it compiles; later runs ~1 min)" in lines
    for step in ("computing a contrastive sentiment vector", "starting vLLM", "generating 9 replies in one batch"):
        assert any(re.fullmatch(rf"✓ {step}: done in \d+\.\d s", line) for line in lines), step
