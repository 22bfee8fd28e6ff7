"""Capture across workers: under pipeline parallelism each stage captures the layers it holds and callers and the
reader see one capture per request; under tensor parallelism only rank 0 publishes. Both equal the capture of a
single-worker engine.

Runs two workers (two stages, or two TP ranks) as two processes: on CPU (threads bound one core per worker) or on two
GPUs.
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
RAW_TAGS = ["raw-0", "raw-1"]  # a second batch, whose records are read per worker
LAYERS = (0, 1, 2, 3)  # the tiny model's four layers: stage 0 holds 0-1, stage 1 holds 2-3


# pp2_fused: sites run inside the add-norms (forward="fused", the default on CUDA); at the stage boundary the last
# layer of stage 0 keeps its post_block op and stage 1's first input norm runs only its own pre_attn
ENGINES = {"single": {}, "pp2": {"pipeline_parallel_size": 2}, "tp2": {"tensor_parallel_size": 2},
           "pp2_fused": {"pipeline_parallel_size": 2, "forward": "fused"},
           "tp2_fused": {"tensor_parallel_size": 2, "forward": "fused"}}


def run(path, name: str, root) -> tuple[list, list[int]]:
    """Outputs of one engine, and how many records each worker returns for a second batch (read raw)."""
    from vllm import SamplingParams

    from dynsteer.capture.result import host_id, unpack_records

    engine = dict(ENGINES[name])
    cfg = DynsteerConfig(capture_sites=SITES, forward=engine.pop("forward", "auto"),
                         capture_consumers={"memory": {}, "filesystem": {"root": str(root), "layout": "packed"}})
    extra = dict(engine, distributed_executor_backend="mp") if engine else {}
    spec = CaptureSpec(layers=LAYERS, sites=SITES, positions="all", consumers=("memory", "filesystem"))
    with make_llm(path, dtype="float32", **extra, **cfg.engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = st.generate(PROMPTS, params, capture=spec)
        # A global capture spec naming layers of both stages is accepted by every worker.
        st.set_capture(CaptureSpec(layers=(1, 3), sites=("post_block",), positions="last_prompt"))
        st.set_capture(None)
        llm.generate(PROMPTS, [dynsteer.steer_params(params, None, tag=t, capture=spec) for t in RAW_TAGS],
                     use_tqdm=False)
        replies = llm.collective_rpc("dynsteer_take_captures", args=(RAW_TAGS, host_id()))
        unpack_records([rec for reply in replies for rec in reply])  # maps and unlinks their shared-memory files
        per_worker = [len(reply) for reply in replies]
    return outs, per_worker


def _worker(path: str, out: str) -> None:
    """Subprocess body: every engine, results saved as .npz (one file per engine and request)."""
    for name in ENGINES:
        outs, per_worker = run(path, name, Path(out) / f"{name}-engine")
        np.save(Path(out) / f"{name}-records-per-worker.npy", np.array(per_worker))
        for i, o in enumerate(outs):
            cap = o.capture
            np.savez(Path(out) / f"{name}-{i}.npz", tokens=np.array(o.outputs[0].token_ids), tag=cap.tag,
                     status=cap.status, prompt_len=len(o.prompt_token_ids), positions=cap.positions,
                     **{place_key(p): a for p, a in cap.arrays.items()})
    print("DONE", flush=True)


@pytest.fixture(scope="module")
def results(tiny_llama_path, tmp_path_factory):
    """Runs the engines in a fresh interpreter: its own multiprocess engine cores (worker processes of an in-process
    engine with two workers keep the interpreter from exiting), and vLLM's CPU workers bound one core each."""
    out = tmp_path_factory.mktemp("workers")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    if not ON_GPU:  # vLLM's CPU workers bind threads per NUMA node; give each worker one core
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    code = f"from tests.test_pipeline_parallel import _worker; _worker({str(tiny_llama_path)!r}, {str(out)!r})"
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
    return out


def _compare(out: Path, name: str, rtol: float) -> list[str]:
    """Each request's capture under ``name`` equals the single-worker one; returns the tags."""
    places = set(CaptureSpec(layers=LAYERS, sites=SITES).places())
    tags = []
    for i in range(len(PROMPTS)):
        one, two = np.load(out / f"single-{i}.npz"), np.load(out / f"{name}-{i}.npz")
        np.testing.assert_array_equal(two["tokens"], one["tokens"])
        assert str(two["status"]) == "ok"
        assert {place_from_key(k) for k in two.files if "." in k} == places  # every layer in one capture
        n = int(one["prompt_len"]) + 7
        assert two["positions"].tolist() == one["positions"].tolist() == list(range(n))
        for place in places:
            ref = one[place_key(place)]
            np.testing.assert_allclose(two[place_key(place)], ref, rtol=rtol, atol=rtol * float(np.abs(ref).max()))
        tags.append(str(two["tag"]))
    return tags


def test_pp2_capture_equals_single_stage(results):
    out = results
    tags = _compare(out, "pp2", rtol=1e-5)
    assert np.load(out / "pp2-records-per-worker.npy").tolist() == [len(PROMPTS)] * 2  # each stage its own layers
    root = out / "pp2-engine"
    assert sorted(p.name for p in root.iterdir()) == ["pp0", "pp1"]  # each stage published its own directory
    reader = CaptureReader(root)
    assert reader.tags() == sorted(tags + RAW_TAGS)
    for i, tag in enumerate(tags):
        saved = np.load(out / f"pp2-{i}.npz")
        positions, arrays, meta = reader.read(tag)  # the reader merges the stages' files
        assert meta["status"] == "ok"
        np.testing.assert_array_equal(positions, saved["positions"])
        assert set(arrays) == {place_from_key(k) for k in saved.files if "." in k}
        for place, values in arrays.items():
            np.testing.assert_array_equal(values, saved[place_key(place)])


def test_pp2_fused_capture_equals_single_stage(results):
    """The fused forward across a stage boundary: every place's capture (and the tokens) equal the single worker's."""
    _compare(results, "pp2_fused", rtol=1e-5)
    assert np.load(results / "pp2_fused-records-per-worker.npy").tolist() == [len(PROMPTS)] * 2


def test_tp2_fused_capture_equals_single_worker(results):
    """The fused forward on two tensor-parallel ranks (the all-reduced branch enters the fused norm on each)."""
    _compare(results, "tp2_fused", rtol=1e-4)
    assert np.load(results / "tp2_fused-records-per-worker.npy").tolist() == [len(PROMPTS), 0]


def test_tp2_only_rank_0_publishes_and_captures_equal_single_worker(results):
    out = results
    # All-reduce sums the partial products in another order: float32 noise, not a different row.
    tags = _compare(out, "tp2", rtol=1e-4)
    assert np.load(out / "tp2-records-per-worker.npy").tolist() == [len(PROMPTS), 0]
    assert CaptureReader(out / "tp2-engine").tags() == sorted(tags + RAW_TAGS)
    assert not list((out / "tp2-engine").glob("pp*"))
