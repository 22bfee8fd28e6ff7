"""Test models: tiny random checkpoints and the converted SmolLM2 load and generate in vLLM on CPU."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys

import pytest

from dynsteer.hardware import AMX_BF16_NOTE, cpu_has_amx_bf16
from dynsteer.testing.tiny_models import CPU_LOADABLE, TINY_ARCHS, TINY_SHAPE, tiny_model
from tests.conftest import ON_GPU, make_llm, texts, token_ids

EXPECTED = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
PROMPTS = ["The capital of France is", "A computer program is a list of"]
# Longer than the Gemma sliding window (64) so the windowed path is compared against transformers too.
LONG_PROMPT = "Mathematics is the language of patterns. " * 12


def _greedy(n: int = 16, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def _digests(path: pathlib.Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.fixture(scope="module")
def tiny_paths() -> dict[str, pathlib.Path]:
    return {arch: tiny_model(arch) for arch in TINY_ARCHS}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_checkpoint_layout(tiny_paths, arch):
    path = tiny_paths[arch]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):  # fmt: skip
        assert (path / name).is_file(), name
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"]) == (list(EXPECTED[arch][:1]), EXPECTED[arch][1])
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (
        TINY_SHAPE["hidden_size"], TINY_SHAPE["num_hidden_layers"], TINY_SHAPE["head_dim"])  # fmt: skip
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert tok_cfg["eos_token"] == "</s>" and tok_cfg["bos_token"] == "<s>"
    assert tiny_model(arch) == path  # cached: no rebuild


def test_tiny_build_is_deterministic_and_concurrency_safe(tiny_paths, tmp_path):
    # Three processes race to build the same checkpoint into a fresh cache directory.
    code = "import sys; from dynsteer.testing import tiny_model; print(tiny_model('qwen2', sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]  # fmt: skip
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1
    built = pathlib.Path(outs[0])
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [built.name]  # no temp dirs left over
    assert _digests(built) == _digests(tiny_paths["qwen2"])


def test_unknown_tiny_arch_is_rejected():
    with pytest.raises(ValueError, match="unknown tiny arch"):
        tiny_model("gpt2")


@pytest.mark.parametrize("arch", CPU_LOADABLE)
def test_tiny_model_generates_in_vllm_like_transformers(tiny_paths, arch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_paths[arch]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [*PROMPTS, LONG_PROMPT]
    with make_llm(path) as llm:
        outs = llm.generate(prompts, _greedy(16, ignore_eos=True))
        chat = llm.chat([{"role": "user", "content": "Hello there"}], _greedy(4))
    got = token_ids(outs)
    assert got[0] != got[1], f"{arch}: greedy output does not depend on the prompt"
    assert all(len(set(ids)) > 2 for ids in got), f"{arch}: degenerate output {texts(outs)}"
    # <s><|im_start|>: the chat template was applied and BOS is not doubled.
    assert chat[0].prompt_token_ids[:2] == tok.convert_tokens_to_ids(["<s>", "<|im_start|>"])

    # vLLM must read the checkpoint exactly as transformers does (rope, softcaps, sliding windows, norms).
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    for prompt, ids in zip(prompts, got):
        enc = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = model.generate(enc, max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, enc.shape[1]:]
        # transformers suppresses EOS under min_new_tokens while vLLM's ignore_eos does not: compare up to it.
        n = ids.index(eos) if eos in ids else len(ids)
        assert ids[:n] == ref.tolist()[:n], f"{arch}: vLLM and transformers disagree on {prompt[:30]!r}"


@pytest.fixture(scope="module")
def smollm2_path() -> pathlib.Path:
    from dynsteer.zoo import smollm2

    try:
        return smollm2()
    except RuntimeError as exc:
        if "could not download" in str(exc):
            pytest.skip(f"SmolLM2 unavailable: {exc}")
        raise


def test_smollm2_checkpoint(smollm2_path):
    cfg = json.loads((smollm2_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        30, 576, 9, 3)  # fmt: skip
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert "<|im_start|>" in json.loads((smollm2_path / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("auto", marks=[pytest.mark.slow, pytest.mark.skipif(
    not ON_GPU and cpu_has_amx_bf16(), reason=AMX_BF16_NOTE)])])
def test_smollm2_knows_paris(smollm2_path, dtype):
    with make_llm(smollm2_path, dtype=dtype) as llm:
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], _greedy(32))
    assert "Paris" in out[0].outputs[0].text
