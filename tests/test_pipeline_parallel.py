"""Capture under pipeline parallelism: each stage captures the layers it holds; callers and the reader see one
capture per request, equal to the capture of a single-stage engine.

Runs two pipeline stages as two worker processes: on CPU (threads bound one core per worker) or on two GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dynsteer
from dynsteer import SITES, CaptureReader, CaptureSpec, DynsteerConfig
from dynsteer.capture.store import place_from_key, place_key
from tests.conftest import ON_GPU, make_llm


def _devices() -> int:
    if not ON_GPU:
        return os.cpu_count() or 1
    import torch

    return torch.cuda.device_count()


pytestmark = pytest.mark.skipif(_devices() < 2, reason="two pipeline stages need two GPUs (or two CPU cores)")
PROMPTS = ["the quick brown fox jumps over", "once upon a time there was"]
LAYERS = (0, 1, 2, 3)  # the tiny model's four layers: stage 0 holds 0-1, stage 1 holds 2-3


def run(path, pp: int, root) -> list:
    from vllm import SamplingParams

    cfg = DynsteerConfig(capture_sites=SITES,
                         capture_consumers={"memory": {}, "filesystem": {"root": str(root), "layout": "packed"}})
    extra = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"} if pp == 2 else {}
    with make_llm(path, dtype="float32", **extra, **cfg.engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = st.generate(PROMPTS, params, capture=CaptureSpec(layers=LAYERS, sites=SITES, positions="all",
                                                                 consumers=("memory", "filesystem")))
        # A global capture spec naming layers of both stages is accepted by every stage.
        st.set_capture(CaptureSpec(layers=(1, 3), sites=("post_block",), positions="last_prompt"))
        st.set_capture(None)
    return outs


def _worker(path: str, out: str) -> None:
    """Subprocess body: both engines, results saved as .npz (one file per engine and request)."""
    for pp in (1, 2):
        for i, o in enumerate(run(path, pp, Path(out) / f"pp{pp}-engine")):
            cap = o.capture
            np.savez(Path(out) / f"pp{pp}-{i}.npz", tokens=np.array(o.outputs[0].token_ids), tag=cap.tag,
                     status=cap.status, prompt_len=len(o.prompt_token_ids), positions=cap.positions,
                     **{place_key(p): a for p, a in cap.arrays.items()})
    print("DONE", flush=True)


def test_pp2_capture_equals_single_stage(tiny_llama_path, tmp_path):
    # A fresh interpreter: its own multiprocess engine cores (worker processes of an in-process engine with two
    # stages keep the interpreter from exiting), and vLLM's CPU workers bound one core each.
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    if not ON_GPU:  # vLLM's CPU workers bind threads per NUMA node; give each stage one core
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    code = f"from tests.test_pipeline_parallel import _worker; _worker({str(tiny_llama_path)!r}, {str(tmp_path)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    for line in proc.stdout:  # the engines' shutdown may linger after the results are written: stop at DONE
        lines.append(line)
        if line.startswith("DONE"):
            break
    proc.kill()
    proc.wait()
    assert lines and lines[-1].startswith("DONE"), "".join(lines[-60:])

    places = set(CaptureSpec(layers=LAYERS, sites=SITES).places())
    reader = CaptureReader(tmp_path / "pp2-engine")
    root = tmp_path / "pp2-engine"
    assert sorted(p.name for p in root.iterdir()) == ["pp0", "pp1"]  # each stage published its own directory
    tags = []
    for i in range(len(PROMPTS)):
        one, two = np.load(tmp_path / f"pp1-{i}.npz"), np.load(tmp_path / f"pp2-{i}.npz")
        np.testing.assert_array_equal(two["tokens"], one["tokens"])
        assert str(two["status"]) == "ok"
        assert {place_from_key(k) for k in two.files if "." in k} == places  # both stages' layers in one capture
        n = int(one["prompt_len"]) + 7
        assert two["positions"].tolist() == one["positions"].tolist() == list(range(n))
        positions, arrays, meta = reader.read(str(two["tag"]))  # the reader merges the stages' files
        assert set(arrays) == places and meta["status"] == "ok"
        np.testing.assert_array_equal(positions, two["positions"])
        for place in places:
            ref = one[place_key(place)]
            np.testing.assert_allclose(two[place_key(place)], ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
            np.testing.assert_array_equal(arrays[place], two[place_key(place)])
        tags.append(str(two["tag"]))
    assert reader.tags() == sorted(tags)
