"""Declarative table of decoder-layer families: where each keeps its residual stream and which sites it has.

Read by :mod:`dynsteer.engine.adapters` (workers, when a model is built) and by the frontend (which sites a spec may
name). Pure data: no vLLM or torch import, so the frontend can read it without loading model code.

Most vLLM text models need no entry here: their decoder layer carries ``(hidden, residual)`` through two fused
add-norm calls ``self.<norm>(hidden_states, residual)`` and the adapters discover both norms from the layer's
``forward`` source. An entry is needed where a family differs:

- ``stream="hidden"``: the layer returns the whole residual stream as ``hidden_states`` (post-norm layers,
  residual multipliers, parallel blocks); a residual it returns or takes is not part of the stream;
- ``mid`` / ``mid_mode``: the module the ``post_attn`` site steers, and how: ``"fused"`` (a fused add-norm called
  as ``mid(hidden, residual)``) or ``"input"`` (a module called with the stream itself, which the layer also keeps
  as its residual: the site edits that tensor in place, so branch and residual both see the steered value);
- ``parallel``: attention and MLP read the same input, so no residual exists between them and ``post_attn`` is
  absent (``True``, or the name of the config flag that says so);
- ``unsupported``: a reason the family cannot be hooked; loading it fails naming the architecture and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Stream = Literal["sum", "hidden"]
MidMode = Literal["fused", "input"]


@dataclass(frozen=True)
class Family:
    """How one family's decoder layer carries the residual stream.

    Args:
        name: Short family name (the architectures table in docs/reference, tests' tiny checkpoints).
        architectures: Hugging Face ``architectures`` names this entry covers.
        stream: ``"sum"``: the stream is ``hidden + residual`` (fused add-norm layers); ``"hidden"``: it is the
            ``hidden_states`` tensor alone.
        mid: Attribute name of the module the ``post_attn`` site steers; None: discovered from ``forward``.
        mid_mode: ``"fused"`` or ``"input"`` (module docstring).
        parallel: ``True`` or the config flag that makes attention and MLP parallel (no ``post_attn``).
        parallel_default: The flag's value when the config lacks it.
        unsupported: Why the family cannot be hooked (None: it can).
    """

    name: str
    architectures: tuple[str, ...]
    stream: Stream = "sum"
    mid: str | None = None
    mid_mode: MidMode = "fused"
    parallel: bool | str = False
    parallel_default: bool = False
    unsupported: str | None = None


_PLAIN = dict(stream="hidden", mid="post_attention_layernorm", mid_mode="input")
_POST_NORM = dict(stream="hidden", mid="mlp", mid_mode="input")
_HYBRID = ("its layers are not all attention blocks (state-space or linear-attention layers keep state outside the "
           "residual pair), which the adapters do not describe")

FAMILIES: tuple[Family, ...] = (
    # Fused (hidden, residual) add-norm, mid norm named explicitly where discovery would also find it.
    Family("llama", ("LlamaForCausalLM", "InternLM3ForCausalLM", "Phi3ForCausalLM", "GlmForCausalLM")),
    Family("mistral", ("MistralForCausalLM", "Ministral3ForCausalLM")),
    Family("qwen2", ("Qwen2ForCausalLM",)),
    Family("qwen3", ("Qwen3ForCausalLM",)),
    Family("gemma", ("GemmaForCausalLM",)),
    # Sandwich norms: the attention branch is normed before the fused add, so the mid norm is the pre-FFN one.
    Family("gemma2", ("Gemma2ForCausalLM",), mid="pre_feedforward_layernorm"),
    Family("gemma3", ("Gemma3ForCausalLM",), mid="pre_feedforward_layernorm"),
    Family("glm4", ("Glm4ForCausalLM",), mid="post_attention_layernorm"),
    Family("mixtral", ("MixtralForCausalLM",)),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",)),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",)),
    Family("olmoe", ("OlmoeForCausalLM",)),
    # Parallel attention + MLP from one norm: the stream is the returned hidden_states.
    Family("cohere", ("CohereForCausalLM", "Cohere2ForCausalLM"), stream="hidden", parallel=True),
    Family("gpt_j", ("GPTJForCausalLM",), stream="hidden", parallel=True),
    Family("gpt_neox", ("GPTNeoXForCausalLM",), parallel="use_parallel_residual", parallel_default=True, **_PLAIN),
    # Un-fused pre-norm layers (residual multipliers included): the mid norm reads the stream the layer keeps.
    Family("granite", ("GraniteForCausalLM",), **_PLAIN),
    Family("granitemoe", ("GraniteMoeForCausalLM",), **_PLAIN),
    Family("stablelm", ("StableLmForCausalLM", "StableLMEpochForCausalLM"), **_PLAIN),
    Family("phimoe", ("PhiMoEForCausalLM",), **_PLAIN),
    Family("orion", ("OrionForCausalLM",), **_PLAIN),
    Family("minicpm", ("MiniCPMForCausalLM",), **_PLAIN),  # depth-scaled branches, like Granite's multiplier
    # Post-norm layers: branch outputs are normed before the add, the MLP reads the stream itself.
    Family("olmo3", ("Olmo3ForCausalLM",), **_POST_NORM),
    Family("exaone4", ("Exaone4ForCausalLM",), **_POST_NORM),
    # Known not to fit.
    Family("gpt2", ("GPT2LMHeadModel",), unsupported=(
        "its blocks take only hidden_states (no positions) and add both branches inside forward; no adapter "
        "describes that layout yet")),
    Family("falcon", ("FalconForCausalLM", "RWForCausalLM"), unsupported=(
        "its block layout (parallel or sequential attention, one or two input norms) is chosen by several config "
        "flags and the attention residual is added in place, which the adapters do not describe")),
    Family("hybrid", ("JambaForCausalLM", "BambaForCausalLM", "FalconH1ForCausalLM", "NemotronHForCausalLM",
                      "Zamba2ForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "GraniteMoeHybridForCausalLM",
                      "Qwen3NextForCausalLM", "MambaForCausalLM", "Mamba2ForCausalLM", "FalconMambaForCausalLM",
                      "KimiLinearForCausalLM", "Plamo2ForCausalLM"), unsupported=_HYBRID),
)

_BY_ARCH: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}


def family_of(architecture: str) -> Family | None:
    """The declared family of an architecture (None: undeclared; the adapters try generic discovery)."""
    return _BY_ARCH.get(architecture)


def is_parallel(family: Family | None, hf_config: Any) -> bool:
    """Whether attention and MLP read the same input in this model (so it has no ``post_attn`` site)."""
    if family is None or family.parallel is False:
        return False
    if family.parallel is True:
        return True
    return bool(getattr(hf_config, family.parallel, family.parallel_default))


def absent_sites(architecture: str, hf_config: Any) -> dict[str, str]:
    """Sites that have no meaning for this model, each with the reason (empty for most architectures)."""
    if is_parallel(family_of(architecture), hf_config):
        return {"post_attn": (f"{architecture} runs attention and the MLP in parallel on the same input: no "
                              f"residual exists between them")}
    return {}
